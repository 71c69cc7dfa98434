"""The FlashAttention-2 reference (Triton) against torch's scaled_dot_product_attention backends on one GPU: cuDNN's,
FlashAttention-2's own CUDA kernels (`flash`) and the memory-efficient one, forward and backward, causal and not, head
sizes 64 and 128.

    python benchmarks/flash_attention.py   # prints the rows and writes benchmarks/results/flash_attention.md

Every side takes the same bfloat16 q, k, v laid out [B, H, T, d], contiguous, made before the timing, so no transpose or
copy is inside a timed call. The forward is timed alone; the backward is torch.autograd.grad to q, k and v from an
output computed once per input set outside the timed call (benchmarks/references.backward_of). Throughput counts the
matmuls only: 4 B H T^2 d FLOPs forward, 2.5 times that backward, halved when causal. A figure is the median of three
runs, each the median of CUDA-event timings over two input sets taken in turn (benchmarks/references.median_ms); the
spread is (slowest - fastest) / median of the three, the largest of the row's sides.

FlashAttention-3's published figures on an H100 SXM5 (Shah et al., 2024: batch x length = 16k tokens, 2048 hidden,
bfloat16, head size 128, length 4096) are 638 TFLOP/s forward and 542 backward, where the same charts give cuDNN 609
and 499; they are quoted beside the rows measured on an H100 for the gap, not measured here.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.references import backward_of, median_and_spread, median_ms
from reference.kernels.flash_attention_triton import flash_attention

BATCH, HEADS, SEQ = 4, 16, 4096
HEAD_DIMS = (64, 128)
RUNS = 3
BACKENDS = {"cuDNN": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
PUBLISHED_H100_FA3 = {("forward", 128): 638, ("backward", 128): 542}  # TFLOP/s, non-causal, length 4096
RESULTS = ROOT / "benchmarks" / "results" / "flash_attention.md"


def sdpa(backend: SDPBackend, causal: bool):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def runs(function, input_sets: list[tuple]) -> tuple[float, float] | None:
    """(median ms, spread) of RUNS timings, or None where the backend refuses these inputs on this GPU."""
    try:
        times = [median_ms(function, input_sets) for _ in range(RUNS)]
    except RuntimeError as refused:  # e.g. a backend not built for this GPU or head size
        print(f"  refused: {str(refused).splitlines()[0]}", flush=True)
        return None
    return median_and_spread(times)


def main() -> None:
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    gpu = torch.cuda.get_device_name(0)
    header = ["| pass | head size | causal | reference (Triton) | " + " | ".join(BACKENDS) +
              " | reference / cuDNN time | spread |",
              "| --- | --- | --- | --- | " + " | ".join("---" for _ in BACKENDS) + " | --- | --- |"]
    lines = []
    for head_dim in HEAD_DIMS:
        for causal in (False, True):
            forward_flops = 4 * BATCH * HEADS * SEQ * SEQ * head_dim / (2 if causal else 1)
            for kind, flops in (("forward", forward_flops), ("backward", 2.5 * forward_flops)):
                grad = kind == "backward"
                input_sets = [tuple(torch.randn(BATCH, HEADS, SEQ, head_dim, device="cuda", dtype=torch.bfloat16,
                                                requires_grad=grad) for _ in range(3)) for _ in range(2)]
                sides = {"reference": lambda q, k, v, c=causal: flash_attention(q, k, v, c),
                         **{name: sdpa(backend, causal) for name, backend in BACKENDS.items()}}
                timed = {name: runs(backward_of(side) if grad else side, input_sets) for name, side in sides.items()}
                rate = lambda name: f"{flops / timed[name][0] / 1e9:.0f}" if timed[name] else "-"
                versus = f"{timed['reference'][0] / timed['cuDNN'][0]:.2f}" if timed["cuDNN"] else "-"
                spread = max(t[1] for t in timed.values() if t)
                lines.append(f"| {kind} | {head_dim} | {'yes' if causal else 'no'} | " +
                             " | ".join(rate(name) for name in sides) + f" | {versus} | {spread:.1%} |")
                print(lines[-1], flush=True)
                del input_sets
                torch.cuda.empty_cache()
    published = [f"- {kind}, head size {d}, not causal: FlashAttention-3 {tflops} TFLOP/s"
                 for (kind, d), tflops in PUBLISHED_H100_FA3.items()]
    versions = (f"{gpu}, torch {torch.__version__}, triton {triton.__version__}, "
                f"cuDNN {torch.backends.cudnn.version()}, python {platform.python_version()}")
    report = "\n".join([
        "# FlashAttention-2 (Triton) against torch's attention backends", "", versions, "",
        f"TFLOP/s, batch {BATCH}, {HEADS} heads, length {SEQ}, bfloat16 (the method: the script's docstring).", "",
        *header, *lines, "",
        "FlashAttention-3's published H100 SXM5 figures (not measured here; length 4096, 16k tokens a batch):", "",
        *published, ""])
    print(report)
    RESULTS.write_text(report)


if __name__ == "__main__":
    main()
