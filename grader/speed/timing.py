"""Timing one kernel call on a GPU, the same way for the student (in its worker) and the reference (in the grader).

Each call gets inputs of its own and a cold L2 (a large buffer is rewritten first), and is timed with CUDA events
from its first kernel: the GPU is kept busy long enough before the start event for the host to launch it. The event
functions are bound when this module is imported, before any student module, so a student module that replaces
torch.cuda.Event or its methods afterwards does not change the measurement (the worker also reports a replaced
Timer: grader.sandbox.worker).
"""

from __future__ import annotations

import torch

_Event = torch.cuda.Event
_record = torch.cuda.Event.record
_elapsed_time = torch.cuda.Event.elapsed_time
_synchronize = torch.cuda.synchronize
_sleep = torch.cuda._sleep  # a one-thread kernel that spins for a number of GPU clock cycles

# Larger than the L2 of any current GPU (H200: 60 MB): rewriting it evicts the previous call's data.
L2_FLUSH_BYTES = 512 * 2**20
# After the flush (~0.13 ms on the H200) the GPU spins this many cycles more (~2 ms at its 1.98 GHz) before the start
# event, while the host enqueues the whole timed call; the host's time to enqueue it would otherwise be timed wherever
# it is longer than the flush. With the flush alone, a 1 MiB softmax timed in the student's worker measured 36 us on
# the H200, against 14 us in the grader's own process (a process woken from idling runs its first Python more slowly).
# A forward and backward through autograd takes the host more than 0.25 ms to enqueue: with a 0.25 ms cover the
# Mamba-2 reference's timed call read 0.40 to 1.06 ms from run to run on one H100, with 2 ms 0.400 every run
# (benchmarks/results/speed_stability.md). The cover costs its 2 ms once per timed call, outside the timed interval.
HOST_COVER_CYCLES = 4_000_000
SAMPLES = 4096


class Timer:
    def __init__(self, device: torch.device):
        self.flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)

    def time_ms(self, function, args: tuple):
        """(milliseconds, output) of one call."""
        self.flush.zero_()
        _sleep(HOST_COVER_CYCLES)
        start, end = _Event(enable_timing=True), _Event(enable_timing=True)
        _record(start)
        output = function(*args)
        _record(end)
        _synchronize()
        return _elapsed_time(start, end), output


def sample(output: torch.Tensor, seed: int) -> torch.Tensor:
    """Elements of `output` at positions drawn from `seed` (float64, on the CPU): a cheap re-check of a timed output.
    The seed is chosen by the grader after the call, so an implementation cannot compute only those positions."""
    flat = output.detach().as_subclass(torch.Tensor).reshape(-1)
    return flat[sample_positions(flat.numel(), seed).to(flat.device)].to("cpu", torch.float64)


def sample_positions(numel: int, seed: int) -> torch.Tensor:
    """The flat positions `sample` takes from an output of `numel` elements (on the CPU)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, max(numel, 1), (SAMPLES,), generator=generator)
