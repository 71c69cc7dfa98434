"""How an attention kernel's work grows with the sequence when each query reads a fixed number of keys (a window, a
top-k): the problems that skip keys measure it here, inside the student's worker (evidence against honest mistakes:
code that defeats the hooks or the clock is not caught).

* Under Triton's interpreter, the lanes of every load forward and backward issue (grader.sandbox.triton_traffic),
  masked lanes included, at three lengths equally far apart: work linear in seq makes the two increments equal, work
  that walks every earlier key makes the second one larger.
* On a GPU, the time of forward and backward at two lengths: linear work grows with their ratio, causal work with its
  square.
"""

from __future__ import annotations

from typing import Callable

import torch

from grader.checks.outcomes import WrongAnswer

TIMED_CALLS, WARMUP_CALLS = 13, 3


def loaded_lanes(step: Callable[[], None]) -> int:
    """The load lanes of step() (a forward and its backward), under the interpreter."""
    from grader.sandbox.triton_traffic import TRAFFIC

    with TRAFFIC.recording():
        step()
        return TRAFFIC.loaded_lanes


def median_seconds(step: Callable[[], None]) -> float:
    """The median time of step() on the GPU, timed with CUDA events after warm-up calls."""
    samples = []
    for index in range(TIMED_CALLS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        if index >= WARMUP_CALLS:
            samples.append(start.elapsed_time(end) / 1000)
    return sorted(samples)[len(samples) // 2]


def check_work_growth(counts: list[int], lengths: tuple[int, ...], fixed: str, limit: float, remedy: str) -> None:
    """counts: load lanes at the three lengths with `fixed` (say "window 16") held; remedy: what linear work needs."""
    first, second = counts[1] - counts[0], counts[2] - counts[1]
    if first <= 0:
        raise WrongAnswer(f"the kernels loaded {counts[0]} lanes at seq = {lengths[0]} and {counts[1]} at "
                          f"{lengths[1]} ({fixed}): no more work for more queries")
    if second > limit * first:
        raise WrongAnswer(
            f"forward and backward loaded {counts} lanes (masked lanes included) at seq = {list(lengths)}, {fixed}: "
            f"the second {lengths[1] - lengths[0]} extra queries cost {second / first:.2f}x the first, above "
            f"{limit}; {remedy}"
        )


def check_time_growth(times: list[float], lengths: tuple[int, ...], fixed: str, limit: float) -> None:
    ratio, growth = times[1] / times[0], lengths[1] // lengths[0]
    if ratio > limit:
        raise WrongAnswer(
            f"forward and backward took {times[0] * 1e3:.2f} ms at seq = {lengths[0]} and {times[1] * 1e3:.2f} ms at "
            f"seq = {lengths[1]} ({fixed}): {ratio:.1f}x for {growth}x the queries, above {limit}; linear work takes "
            f"{growth}x, causal attention's {growth**2}x"
        )
