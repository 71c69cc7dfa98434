"""A pipeline's bubble, measured: the student's pipeline_step timed over stages whose work is a sleep.

Each stage is a linear layer followed by a sleep of FORWARD_S in forward and BACKWARD_S in backward. A sleep takes the
same time on any machine and uses no core, so the step's wall time measures the schedule, not the machine: stages that
run concurrently leave a bubble near (p - 1) / (m + p - 1), stages that wait for one another leave one near 1 - 1/p.
The pipeline runs on the CPU over a gloo group of all the ranks, on a GPU host too: under NCCL a receive returns to
the host before the data arrives, so a stage's sleep would not wait for its input. The measurement is thus the same on
every machine. Both parallel.pipeline (its stages must overlap) and parallel.analysis (the bubble a student measured)
time it here.

The times are taken in the rank processes, beside the student's code (in-process evidence).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

FORWARD_S, BACKWARD_S = 0.04, 0.08
WIDTH, ROWS_PER_MICRO_BATCH = 8, 2
# The first step of a schedule also opens the connections between neighbours; the fastest of the steps after it is
# the one least disturbed by other processes on the machine.
WARMUP_STEPS, TIMED_STEPS = 1, 2


class Sleep(torch.autograd.Function):
    """Identity whose forward sleeps forward_s and whose backward sleeps backward_s: wall time that uses no core.
    bucket_time's layers use it too, with a forward that does not sleep."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepStage(torch.nn.Module):
    """One stage: a linear layer (so that the stage has parameters and a gradient to send back), then Sleep."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return Sleep.apply(self.linear(x), FORWARD_S, BACKWARD_S)


def step_seconds_on_rank(student, rank: int, world_size: int, cases: list[tuple[str, int]]) -> list[float]:
    """Runs in a rank process: for each (schedule, micro-batches) case, the fastest of TIMED_STEPS steps' wall time,
    each step from a barrier before pipeline_step to one after it, so that every rank's time spans the whole step."""
    group = dist.new_group(backend="gloo")  # every rank, on the host
    torch.manual_seed(rank)
    stage = SleepStage()
    fastest = []
    for schedule, micro_batches in cases:
        rows = ROWS_PER_MICRO_BATCH * micro_batches
        inputs = torch.randn(rows, WIDTH) if rank == 0 else None
        targets = torch.randn(rows, WIDTH) if rank == world_size - 1 else None
        seconds = []
        for _ in range(WARMUP_STEPS + TIMED_STEPS):
            dist.barrier(group=group)
            started = time.perf_counter()
            student.pipeline_step(stage, inputs, targets, micro_batches, schedule, (ROWS_PER_MICRO_BATCH, WIDTH),
                                  torch.nn.functional.mse_loss, group=group)
            dist.barrier(group=group)
            seconds.append(time.perf_counter() - started)
            stage.zero_grad(set_to_none=True)
        fastest.append(min(seconds[WARMUP_STEPS:]))
    return fastest


def measured_bubbles(ranks, world_size: int, cases: list[tuple[str, int]]) -> list[float]:
    """Per (schedule, micro-batches) case, 1 - m (t_f + t_b) / step time, the step time the longest any rank saw."""
    per_rank = ranks.run(step_seconds_on_rank, world_size, cases)
    return [1 - micro_batches * (FORWARD_S + BACKWARD_S) / max(seconds[index] for seconds in per_rank)
            for index, (_, micro_batches) in enumerate(cases)]


def ideal_bubble(stages: int, micro_batches: int) -> float:
    return (stages - 1) / (micro_batches + stages - 1)


def serial_bubble(stages: int) -> float:
    """The bubble when each stage starts only after the one before it has finished every micro-batch."""
    return 1 - 1 / stages
