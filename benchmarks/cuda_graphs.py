"""A step's GPU time replayed from a CUDA graph: the kernels' own time, without the host's cost of launching them,
which for a step of many small launches (or one short kernel behind a Python wrapper) can be most of its eager time."""

from __future__ import annotations

from collections.abc import Callable

import torch


def replay_ms(step: Callable[[], object], warmup: int = 5, rep: int = 100) -> float:
    """Median milliseconds of `step` captured once in a CUDA graph and timed as replays (triton.testing.do_bench with
    `warmup` and `rep` milliseconds)."""
    import triton.testing  # only here, so that a benchmark's CPU-only quick run works where triton is missing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, allocate) off the default stream, as capture asks
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")
