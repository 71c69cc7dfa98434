"""Every reference kernel against its torch counterpart on one GPU, as a fraction of the measured ceiling.

    python benchmarks/references.py                # prints the table and writes benchmarks/results/references.md
    python benchmarks/references.py --memory-only  # the memory-bound rows alone: results/references_memory.md

Memory-bound kernels (softmax, GeLU, row sums, RMSNorm forward) are held to the bandwidth of a device-to-device copy
(bytes read plus bytes written, measured here); matmul and attention to the bf16 matmul rate of torch.matmul at
8192^3 (measured here). Times are medians of CUDA-event timings (triton.testing.do_bench) with inputs rotated among
several buffers so that no call is served from the 60 MB L2.

A memory-bound call on 64 MB takes about 25 us of GPU time, no more than the host takes to launch it through a Python
wrapper, so back-to-back eager calls can time the host instead of the kernel. Those rows are also timed replayed from
a CUDA graph (`graph-replayed`: one graph calls the kernel once on each buffer, the copy likewise), which leaves only
the GPU's time; a row that reaches the copy there but not eagerly is bound by its launch, not by its kernel.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.cuda_graphs import replay_ms

BUFFERS = 4


def reference(name: str):
    return importlib.import_module(f"reference.kernels.{name}")


def median_ms(function, input_sets: list[tuple]) -> float:
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(input_sets)
        function(*input_sets[state["i"]])

    return triton.testing.do_bench(call, warmup=50, rep=300, return_mode="median")


def median_and_spread(times_ms: list[float]) -> tuple[float, float]:
    """The median of repeated timings and their spread, (slowest - fastest) / median: how far one run can be from
    the next."""
    ordered = sorted(times_ms)
    median = ordered[len(ordered) // 2]
    return median, (ordered[-1] - ordered[0]) / median


def graph_ms(function, input_sets: list[tuple]) -> float:
    """Median milliseconds per call of `function` replayed from one CUDA graph that calls it on each input set in turn:
    the GPU's time, with no host launch between the calls."""
    step = lambda: [function(*args) for args in input_sets]
    return replay_ms(step, warmup=20, rep=300) / len(input_sets)


@dataclass
class Case:
    kernel: str
    shape: str
    ours: object
    theirs: object
    make: object  # () -> tuple of arguments
    work: float  # bytes moved (memory-bound) or FLOPs (compute-bound)
    bound: str  # "memory" or "compute"


def randn(*shape, dtype=torch.bfloat16, requires_grad=False):
    return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=requires_grad)


def memory_cases() -> list[Case]:
    cases = []
    for rows, cols in ((8192, 4096), (4096, 32768)):
        for dtype in (torch.float32, torch.bfloat16):
            size = rows * cols * dtype.itemsize
            label = f"{rows}x{cols} {str(dtype).removeprefix('torch.')}"
            x = lambda rows=rows, cols=cols, dtype=dtype: (randn(rows, cols, dtype=dtype),)
            w = lambda rows=rows, cols=cols, dtype=dtype: (randn(rows, cols, dtype=dtype),
                                                           randn(cols, dtype=dtype))
            cases += [
                Case("softmax", label, reference("softmax").softmax, lambda t: torch.softmax(t, -1), x, 2 * size,
                     "memory"),
                Case("gelu", label, reference("gelu").gelu, lambda t: F.gelu(t, approximate="tanh"), x, 2 * size,
                     "memory"),
                Case("row_sum", label, reference("row_sum").row_sum, lambda t: t.sum(-1), x, size, "memory"),
                Case("rmsnorm forward", label, lambda t, g: reference("rmsnorm").rmsnorm(t, g),
                     lambda t, g: F.rms_norm(t, (t.shape[-1],), g, 1e-6), w, 2 * size, "memory"),
            ]
    return cases


def compute_cases() -> list[Case]:
    cases = []
    for n in (4096, 8192):
        ab = lambda n=n: (randn(n, n), randn(n, n))
        cases.append(Case("matmul bf16", f"{n}^3", reference("matmul").matmul, torch.matmul, ab, 2 * n**3, "compute"))
    flash = reference("flash_attention_triton").flash_attention
    for head_dim in (64, 128):
        for causal in (False, True):
            batch, heads, seq = 4, 16, 4096
            flops = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
            qkv = lambda d=head_dim: tuple(randn(4, 16, 4096, d) for _ in range(3))
            label = f"b4 h16 n4096 d{head_dim}{' causal' if causal else ''}"

            def sdpa(q, k, v, causal=causal):
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            cases.append(Case("attention forward", label, lambda q, k, v, c=causal: flash(q, k, v, c), sdpa, qkv,
                              flops, "compute"))
            grad_qkv = lambda d=head_dim: tuple(randn(4, 16, 4096, d, requires_grad=True) for _ in range(3))
            cases.append(Case("attention backward", label, backward_of(lambda q, k, v, c=causal: flash(q, k, v, c)),
                              backward_of(sdpa), grad_qkv, 2.5 * flops, "compute"))
    return cases


def backward_of(forward):
    """Time only the backward: the forward runs once per input set, outside the timed call."""
    cache = {}

    def run(q, k, v):
        key = id(q)
        if key not in cache:
            out = forward(q, k, v)
            cache[key] = (out, torch.randn_like(out))
        out, grad = cache[key]
        torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

    return run


def copy_bandwidth() -> float:
    """TB/s of a device-to-device copy of 1 GiB float32 buffers (bytes read plus bytes written)."""
    copy_in = [(randn(8192, 32768, dtype=torch.float32),) for _ in range(BUFFERS)]
    copy_out = torch.empty_like(copy_in[0][0])
    copy_bytes = 2 * copy_out.numel() * copy_out.element_size()
    return copy_bytes / median_ms(copy_out.copy_, copy_in) / 1e9


def matmul_rate() -> float:
    """TFLOP/s of torch.matmul at 8192^3 in the default dtype of randn here."""
    mm = [(randn(8192, 8192), randn(8192, 8192)) for _ in range(2)]
    return 2 * 8192**3 / median_ms(torch.matmul, mm) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory-only", action="store_true", help="time the memory-bound rows alone")
    memory_only = parser.parse_args().memory_only
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    bandwidth, compute = copy_bandwidth(), matmul_rate()
    lines = [
        f"ceilings: copy {bandwidth:.2f} TB/s, torch bf16 matmul 8192^3 {compute:.0f} TFLOP/s", "",
        "A copy of a smaller tensor does not reach the peak (launch and the last wave weigh more), so memory-bound "
        "kernels are also held to a copy of their own input, timed in the same way (`of copy at this size`), eagerly "
        "and replayed from a CUDA graph (`graph-replayed`, see the script's docstring).", "",
        "| kernel | case | reference | of ceiling | of copy at this size | of copy, graph-replayed | torch "
        "| reference / torch time |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in memory_cases() + ([] if memory_only else compute_cases()):
        inputs = [case.make() for _ in range(BUFFERS if case.bound == "memory" else 2)]
        ours_ms, theirs_ms = median_ms(case.ours, inputs), median_ms(case.theirs, inputs)
        unit, ceiling = ("TB/s", bandwidth) if case.bound == "memory" else ("TFLOP/s", compute)
        rate = lambda ms: case.work / ms / 1e9  # per ms to per s, in tera
        of_copy_here = of_copy_replayed = "-"
        if case.bound == "memory":
            source = inputs[0][0]
            target = torch.empty_like(source)
            copy = lambda t, *_: target.copy_(t)
            copy_rate = lambda ms: 2 * source.numel() * source.element_size() / ms / 1e9
            of_copy_here = f"{rate(ours_ms) / copy_rate(median_ms(copy, inputs)):.0%}"
            of_copy_replayed = f"{rate(graph_ms(case.ours, inputs)) / copy_rate(graph_ms(copy, inputs)):.0%}"
            del target
        lines.append(f"| {case.kernel} | {case.shape} | {rate(ours_ms):.2f} {unit} | {rate(ours_ms) / ceiling:.0%} | "
                     f"{of_copy_here} | {of_copy_replayed} | {rate(theirs_ms):.2f} {unit} | "
                     f"{ours_ms / theirs_ms:.2f} |")
        print(lines[-1], flush=True)
        del inputs
        torch.cuda.empty_cache()
    versions = (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
                f"python {platform.python_version()}")
    name = "references_memory.md" if memory_only else "references.md"
    report = "\n".join(["# Reference kernels against torch", "", versions, "", *lines, ""])
    print(report)
    (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (ROOT / "benchmarks" / "results" / name).write_text(report)


if __name__ == "__main__":
    main()
