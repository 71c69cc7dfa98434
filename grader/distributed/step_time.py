"""Step time of a distributed training program, the student's against the reference's, as a ratio measured in one run.

Launches alternate (student, reference, student, reference, ...) so that clocks, temperature and other load affect
both alike. Each launch runs `program(module, rank, world_size, *args)` on every rank; the program times its own
training steps after warm-up (CUDA events) and returns a dict with "step_times_s", a list of seconds per timed step.
A step is as slow as its slowest rank, so a launch's step time is the median over steps of the maximum over ranks;
the verdict uses the median over rounds of those.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


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


def compare_step_times(ranks, program, world_size: int, *args, rounds: int = 3) -> StepTimes:
    """`rounds` alternating launches of `program` with the student's module and with the reference's."""
    student, reference = [], []
    for _ in range(rounds):
        student_results = ranks.run(program, world_size, *args)
        student.append(launch_step_time(student_results))
        reference_results = ranks.run_reference(program, world_size, *args)
        reference.append(launch_step_time(reference_results))
    return StepTimes(statistics.median(student), statistics.median(reference), student_results, reference_results)
