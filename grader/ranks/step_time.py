"""Step time of a distributed training program, the student's against the reference's, as a ratio measured in one run.

Launches alternate (student, reference, student, reference, ...) so that clocks, temperature and other load affect
both alike. Each launch runs `program(module, rank, world_size, *args)` on every rank; the program times its own
training steps with `time_steps` and returns its dict. A step is as slow as its slowest rank, so a launch's step time
is the median over steps of the maximum over ranks; the verdict uses the median over rounds of those.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from grader.checks.outcomes import WrongAnswer
from grader.speed.grading import ON_SUBMISSION, tier_fraction

WARMUP_STEPS = 3
TIMED_STEPS = 10


def time_steps(step: Callable[[], torch.Tensor]) -> dict:
    """Runs in a rank process on its GPU: `step()` (one whole training step, returning its loss) WARMUP_STEPS +
    TIMED_STEPS times. A step's time is the wall time between two device synchronisations, so it holds everything
    the step launched, communication on other streams included. Returns "step_times_s" and every step's "losses"."""
    step_times_s, losses = [], []
    for index in range(WARMUP_STEPS + TIMED_STEPS):
        torch.cuda.synchronize()
        started = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        if index >= WARMUP_STEPS:
            step_times_s.append(time.perf_counter() - started)
        losses.append(float(loss))  # after the clock stopped: reading it back synchronises
    return {"step_times_s": step_times_s, "losses": losses}


def weight_sums(tensors) -> dict:
    """A checksum of trained weights, and the scale it is compared on."""
    tensors = [t.detach().double() for t in tensors]
    return {"weight_sum": sum(t.sum().item() for t in tensors),
            "weight_abs_sum": sum(t.abs().sum().item() for t in tensors)}


def check_same_training(student_results: list[dict], reference_results: list[dict], rtol: float) -> None:
    """The timed runs trained the same model as the reference's: every step's loss within `rtol`, and the weights'
    sum within `rtol` of the sum of their magnitudes (programs return `time_steps`' dict updated with `weight_sums`)."""
    for rank, (got, want) in enumerate(zip(student_results, reference_results)):
        for step, (a, b) in enumerate(zip(got["losses"], want["losses"]), start=1):
            if not abs(a - b) <= rtol * abs(b) + 1e-6:  # also catches NaN
                raise WrongAnswer(f"timed run, rank {rank}: loss {a:.6g} at step {step}, the reference's {b:.6g}")
        if not abs(got["weight_sum"] - want["weight_sum"]) <= rtol * want["weight_abs_sum"]:
            raise WrongAnswer(f"timed run, rank {rank}: the weights sum to {got['weight_sum']:.6g} after training, "
                              f"the reference's to {want['weight_sum']:.6g}")


@dataclass
class StepTimes:
    student_s: float
    reference_s: float
    # Every rank's dict from the last round, for re-checking that the timed runs computed the right thing.
    student_results: list[dict]
    reference_results: list[dict]

    @property
    def ratio(self) -> float:
        return self.student_s / self.reference_s

    def describe(self) -> str:
        return (f"{self.student_s * 1e3:.2f} ms per step, {self.ratio:.2f}x the reference "
                f"({self.reference_s * 1e3:.2f} ms)")


def launch_step_time(results: list[dict]) -> float:
    """Median over steps of the slowest rank's time for that step."""
    per_rank = [result["step_times_s"] for result in results]
    steps = {len(times) for times in per_rank}
    if len(steps) != 1 or 0 in steps:
        raise ValueError(f"ranks timed different or no numbers of steps: {sorted(steps)}")
    return statistics.median(max(times) for times in zip(*per_rank))


def secret_data_seeds(world_size: int) -> list[dict]:
    """Each rank's {"data_seed": ...}, drawn here and given to that rank alone: the seed of its own synthetic batch,
    which no other rank can rebuild, so that the re-check of the timed training needs the ranks to communicate."""
    return [{"data_seed": random.SystemRandom().getrandbits(40)} for _ in range(world_size)]


def compare_step_times(ranks, program, world_size: int, *args, rounds: int = 3) -> StepTimes:
    """`rounds` alternating launches of `program` with the student's module and with the reference's, every launch
    with the same secret data seeds."""
    student, reference = [], []
    rank_data = secret_data_seeds(world_size)
    for _ in range(rounds):
        student_results = ranks.run(program, world_size, *args, rank_data=rank_data)
        student.append(launch_step_time(student_results))
        reference_results = ranks.run_reference(program, world_size, *args, rank_data=rank_data)
        reference.append(launch_step_time(reference_results))
    return StepTimes(statistics.median(student), statistics.median(reference), student_results, reference_results)


def grade_step_time(ranks, partial_credit, program, world_size: int, args: tuple, threshold, what: str,
                    rtol: float) -> None:
    """The speed test of a distributed problem: step-time ratio to the reference, scored by `threshold`'s tiers,
    after checking that the timed runs trained alike (`check_same_training` with `rtol`). The students' copy has no
    reference to time on its ranks: there the points are left to the graded submission."""
    if ranks.store is not None and ranks.store.mode == "replay":
        pytest.skip(f"{what}: timed against the reference's own ranks, which the students' copy does not have: "
                    f"{ON_SUBMISSION}")
    times = compare_step_times(ranks, program, world_size, *args)
    measured = f"{what}, {world_size} GPUs: {times.describe()}"
    try:
        check_same_training(times.student_results, times.reference_results, rtol)
    except WrongAnswer as error:
        raise WrongAnswer(f"{error} ({measured})") from None
    fraction = tier_fraction(times.ratio, threshold)
    message = f"{measured}: {fraction:.0%} of the speed points"
    if fraction == 0:
        raise WrongAnswer(message)
    partial_credit(fraction, message)
