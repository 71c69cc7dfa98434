"""The reference MoE layer (forward and backward) against an idealised grouped GEMM of the same FLOPs, on one GPU.

    python benchmarks/moe_layer.py           # prints the table and writes benchmarks/results/moe_layer.md

The configuration is the speed test's: T = 16384 tokens of width D = 2048, E = 64 routed experts of hidden size
H = 1408 with top-6 routing, and S = 2 shared experts of hidden size 1408, in bfloat16. The idealised grouped GEMM
(grader.moe.test_moe_layer.idealised_grouped_gemm) runs the T k routed rows through one expert's weights as plain
dense matmuls, plus the shared experts: every FLOP of the layer, with none of the routing, sorting, gathering or
per-expert launches. The ratio of the two times is the cost of the dispatch. Times are medians of CUDA-event timings
(triton.testing.do_bench) of torch.autograd.grad of the output to all eight inputs, alternating between two input
sets (each over 1 GB, so neither is served from the L2).
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import torch
import triton
import triton.testing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grader.moe.speed_cases import idealised_grouped_gemm, moe_layer_inputs
from reference.moe.moe_layer import moe_layer

SHAPE = (16384, 2048, 1408, 64, 6, 2)  # T, D, H, E, k, S
DTYPE = "bfloat16"
INPUT_SETS = 2


def forward_backward_ms(layer, input_sets: list[tuple]) -> float:
    """Median milliseconds of one forward and backward (gradients returned, not accumulated into .grad)."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(input_sets)
        *tensors, k, upstream = input_sets[state["i"]]
        y_TD = layer(*tensors, k)
        torch.autograd.grad(y_TD, tensors, upstream, allow_unused=True)  # the idealised GEMM ignores the router

    return triton.testing.do_bench(call, warmup=5, rep=200, return_mode="median")


def first_expert_only(inputs: tuple) -> tuple:
    """The inputs with the routed weights cut to expert 0, the only one the idealised GEMM uses: its backward then
    writes no zero gradients for the other experts."""
    x_TD, router_ED, gate_EHD, up_EHD, down_EDH, *rest = inputs
    return (x_TD, router_ED, *(w[:1].detach().requires_grad_(True) for w in (gate_EHD, up_EHD, down_EDH)), *rest)


def layer_flops(tokens: int, width: int, hidden: int, k: int, shared: int) -> float:
    """Matmul FLOPs of a forward and backward: three projections of D x H per routed (token, slot) and per (token,
    shared expert), 2 FLOPs per multiply-add, and a backward of twice the forward. The router (2 T D E) is left out."""
    forward = 2 * 3 * width * hidden * tokens * (k + shared)
    return 3 * forward


def bf16_matmul_rate(device: torch.device) -> float:
    """TFLOP/s of torch.matmul on two 8192^2 bf16 matrices: the GPU's practical matmul rate."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return 2 * 8192**3 / triton.testing.do_bench(lambda: torch.matmul(a, a), return_mode="median") / 1e9


def main() -> None:
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    device = torch.device("cuda")
    tokens, width, hidden, experts, k, shared = SHAPE
    matmul_rate = bf16_matmul_rate(device)
    input_sets = [moe_layer_inputs(SHAPE, DTYPE, seed, device) for seed in range(INPUT_SETS)]
    reference_ms = forward_backward_ms(moe_layer, input_sets)
    ideal_ms = forward_backward_ms(idealised_grouped_gemm, [first_expert_only(inputs) for inputs in input_sets])
    flops = layer_flops(tokens, width, hidden, k, shared)
    rate = lambda ms: flops / ms / 1e9  # per ms to per s, in tera
    lines = [
        f"T={tokens}, D={width}, H=F={hidden}, E={experts}, k={k}, S={shared}, {DTYPE}; forward and backward, "
        f"{flops / 1e12:.2f} TFLOP of expert matmuls; torch bf16 matmul 8192^3: {matmul_rate:.0f} TFLOP/s",
        "",
        "| layer | time | TFLOP/s |",
        "| --- | --- | --- |",
        f"| reference moe_layer | {reference_ms:.2f} ms | {rate(reference_ms):.0f} |",
        f"| idealised grouped GEMM | {ideal_ms:.2f} ms | {rate(ideal_ms):.0f} |",
        "",
        f"reference / idealised grouped GEMM: {reference_ms / ideal_ms:.2f}x",
    ]
    versions = (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
                f"python {platform.python_version()}")
    report = "\n".join(["# The reference MoE layer against an idealised grouped GEMM", "", versions, "", *lines, ""])
    print(report)
    (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (ROOT / "benchmarks" / "results" / "moe_layer.md").write_text(report)


if __name__ == "__main__":
    main()
