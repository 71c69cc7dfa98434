"""The sliding-window attention reference (forward, and forward with backward) against the causal FlashAttention-2
reference over the whole sequence and torch's flex_attention with a sliding-window block mask, on one GPU, and its
time per token as the sequence grows at a fixed window.

    python benchmarks/sliding_window.py [--backward-configs]

writes benchmarks/results/sliding_window.md. Shapes: batch 4, 16 heads, head size 128, window 1024, bfloat16, T =
8192 and 32768. The causal reference does about T^2 / 2 score entries per (batch, head), the window about T w: the
ideal speed-up is T / (2 w), and the target is 0.7 of that. flex_attention is compiled once per shape, its block
mask built outside the timed call; it is a benchmark-only comparison, which the grader never imports. Times are
medians of CUDA-event timings (triton.testing.do_bench); the backward is torch.autograd.grad to q, k and v.

--backward-configs times forward and backward at T = 32768 under each backward block configuration of
BACKWARD_CONFIGS instead (the sweep behind the reference's `_backward_config`; run it on a new GPU model before
choosing its configs) and writes benchmarks/results/sliding_window_backward_configs.md.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys
from pathlib import Path

import torch
import triton
import triton.testing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import config_sweep
from reference.attention import sliding_window as window_module
from reference.attention.sliding_window import sliding_window_attention
from reference.kernels.flash_attention_triton import flash_attention

BATCH, HEADS, HEAD_DIM, WINDOW = 4, 16, 128, 1024
LENGTHS = (8192, 32768)
SCALING_LENGTHS = (2048, 4096, 8192, 16384, 32768)
TARGET_FRACTION = 0.7  # of the ideal speed-up T / (2 w) over causal attention
DTYPE = torch.bfloat16
RESULTS = ROOT / "benchmarks" / "results" / "sliding_window.md"
# The backward's programs: BLOCK_MAJOR rows of their own side (keys for dK and dV, queries for dQ) against blocks of
# BLOCK_MINOR rows of the other side, as reference.attention.sliding_window._backward_config names them.
BACKWARD_CONFIGS = [dict(BLOCK_MAJOR=major, BLOCK_MINOR=minor, num_warps=warps, num_stages=stages)
                    for (major, minor), warps, stages in itertools.product(
                        ((128, 64), (128, 32), (128, 128), (64, 64), (64, 32)), (4, 8), (2, 3, 4))]
BACKWARD_RESULTS = ROOT / "benchmarks" / "results" / "sliding_window_backward_configs.md"


def inputs(seq: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=generator, device="cuda", dtype=DTYPE)
            .requires_grad_(True) for _ in range(3)]


def milliseconds(function, tensors: list[torch.Tensor], backward: bool) -> float:
    def call():
        out = function(*tensors)
        if backward:
            torch.autograd.grad(out, tensors, torch.ones_like(out))

    return triton.testing.do_bench(call, warmup=5, rep=100, return_mode="median")


def flex(seq: int):
    """flex_attention, compiled, with the window's block mask (key j visible to query i iff i - w < j <= i)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def in_window(batch, head, query, key):
        return (key <= query) & (query - key < WINDOW)

    block_mask = create_block_mask(in_window, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device="cuda")
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def comparison_rows() -> list[str]:
    rows = []
    for seq in LENGTHS:
        tensors = inputs(seq)
        target = TARGET_FRACTION * seq / (2 * WINDOW)
        flex_call = flex(seq)
        for backward in (False, True):
            ours = milliseconds(lambda q, k, v: sliding_window_attention(q, k, v, WINDOW), tensors, backward)
            causal = milliseconds(lambda q, k, v: flash_attention(q, k, v, is_causal=True), tensors, backward)
            theirs = milliseconds(flex_call, tensors, backward)
            rows.append(f"| {seq} | {'forward + backward' if backward else 'forward'} | {ours:.2f} | {causal:.2f} | "
                        f"{causal / ours:.1f} | {target:.1f} | {theirs:.2f} | {ours / theirs:.2f} |")
            print(rows[-1], flush=True)
        del tensors
        torch.cuda.empty_cache()
    return rows


def scaling_row() -> str:
    per_token = []
    for seq in SCALING_LENGTHS:
        ms = milliseconds(lambda q, k, v: sliding_window_attention(q, k, v, WINDOW), inputs(seq), backward=True)
        per_token.append(ms * 1e6 / (BATCH * seq))
        torch.cuda.empty_cache()
    row = "| " + " | ".join(f"{ns:.1f}" for ns in per_token) + f" | {max(per_token) / min(per_token):.2f} |"
    print(row, flush=True)
    return row


def write_backward_configs(machine: str) -> None:
    seq = LENGTHS[-1]
    tensors = inputs(seq)
    timed = config_sweep.sweep(window_module, "_backward_config", BACKWARD_CONFIGS, lambda: milliseconds(
        lambda q, k, v: sliding_window_attention(q, k, v, WINDOW), tensors, backward=True))
    BACKWARD_RESULTS.write_text("\n".join([
        "# Sliding-window attention: backward block configurations",
        "",
        f"Measured on {machine}. Forward and backward, batch {BATCH}, {HEADS} heads, T {seq}, head size {HEAD_DIM}, "
        f"window {WINDOW}, {str(DTYPE).removeprefix('torch.')}; milliseconds, fastest first. Written by "
        "`python benchmarks/sliding_window.py --backward-configs`.",
        "",
        *config_sweep.table(timed, window_module._backward_config(DTYPE, HEAD_DIM)),
        "",
    ]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backward-configs", action="store_true",
                        help="time the backward's block configurations instead (see the module's docstring)")
    args = parser.parse_args()
    machine = (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
               f"Python {platform.python_version()}")
    print(machine, flush=True)
    if args.backward_configs:
        write_backward_configs(machine)
        return
    rows = comparison_rows()
    scaling = scaling_row()
    RESULTS.write_text("\n".join([
        "# Sliding-window attention: reference against causal attention and flex_attention",
        "",
        f"Measured on {machine}. Batch {BATCH}, {HEADS} heads, head size {HEAD_DIM}, window {WINDOW}, "
        f"{str(DTYPE).removeprefix('torch.')}; medians of CUDA-event timings, milliseconds. Written by "
        "`python benchmarks/sliding_window.py`.",
        "",
        "Causal: the FlashAttention-2 reference (`kernels.flash_attention_triton`) over the whole sequence. "
        f"Target: {TARGET_FRACTION} T / (2 w), the speed-up over causal attention the window must reach. flex: "
        "torch's flex_attention, compiled, with the window as a block mask.",
        "",
        "| T | pass | window ms | causal ms | causal / window | target | flex ms | window / flex |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Time per token (ns), forward and backward, window {WINDOW}: flat in T when the work is T w.",
        "",
        "| " + " | ".join(f"T = {seq}" for seq in SCALING_LENGTHS) + " | max / min |",
        "|" + "---|" * (len(SCALING_LENGTHS) + 1),
        scaling,
        "",
    ]))


if __name__ == "__main__":
    main()
