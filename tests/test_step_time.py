"""The step-time verdict of distributed speed tests, on made-up launches: it runs on GPUs only, so CI checks its
arithmetic and its refusals here."""

from __future__ import annotations

import math
import types

import pytest

from assignment.registry import SpeedThreshold
from grader.checks.outcomes import WrongAnswer
from grader.ranks.step_time import check_same_training, grade_step_time, launch_step_time

THRESHOLD = SpeedThreshold(shapes=((1,),))


def rank_result(step_times_s, losses=(2.0, 1.5), weight_sum=10.0, weight_abs_sum=100.0) -> dict:
    return {"step_times_s": list(step_times_s), "losses": list(losses), "weight_sum": weight_sum,
            "weight_abs_sum": weight_abs_sum}


class FakeRanks:
    """Launches that return fixed per-rank results: the student's, then the reference's."""

    store = None  # the live grader's: the reference runs

    def __init__(self, student: list[dict], reference: list[dict]):
        self.student, self.reference = student, reference
        self.order = []
        self.rank_data = []

    def run(self, program, world_size, *args, rank_data):
        self.order.append("student")
        self.rank_data.append(rank_data)
        return self.student

    def run_reference(self, program, world_size, *args, rank_data):
        self.order.append("reference")
        self.rank_data.append(rank_data)
        return self.reference


def graded(student_step_s: float, student: dict | None = None) -> tuple[FakeRanks, list]:
    reference = [rank_result([0.010, 0.010, 0.010])] * 2
    ranks = FakeRanks([rank_result([student_step_s] * 3, **(student or {}))] * 2, reference)
    awarded = []
    grade_step_time(ranks, lambda fraction, why: awarded.append((fraction, why)), None, 2, (), THRESHOLD, "case",
                    rtol=1e-3)
    return ranks, awarded


def test_launch_step_time_is_median_over_steps_of_slowest_rank():
    # Steps' slowest ranks: 3, 5, 4 ms -> median 4 ms.
    assert launch_step_time([rank_result([0.003, 0.001, 0.004]), rank_result([0.002, 0.005, 0.001])]) == 0.004
    with pytest.raises(ValueError, match="different or no numbers of steps"):
        launch_step_time([rank_result([0.001]), rank_result([0.001, 0.002])])


def test_tiers_and_alternation():
    ranks, awarded = graded(0.012)
    assert ranks.order == ["student", "reference"] * 3
    assert awarded[0][0] == 1.0 and "1.20x the reference" in awarded[0][1]
    assert graded(0.015)[1][0][0] == 0.5
    with pytest.raises(WrongAnswer, match=r"2\.50x the reference.*0% of the speed points"):
        graded(0.025)


@pytest.mark.parametrize("student, fragment", [
    ({"losses": (2.0, 1.6)}, "loss 1.6 at step 2"),
    ({"losses": (2.0, math.nan)}, "loss nan at step 2"),
    ({"weight_sum": 10.5}, "the weights sum to 10.5"),
])
def test_training_that_differs_is_refused_with_its_time(student, fragment):
    with pytest.raises(WrongAnswer, match=fragment) as refused:
        graded(0.010, student)
    assert "1.00x the reference" in str(refused.value)


def test_rounding_within_tolerance_is_accepted():
    want = [rank_result([0.01])]
    check_same_training([rank_result([0.01], losses=(2.0005, 1.5), weight_sum=10.09)], want, rtol=1e-3)


def test_every_launch_gets_the_same_secret_seed_per_rank_and_ranks_differ():
    ranks, _ = graded(0.011)
    first = ranks.rank_data[0]
    assert all(data == first for data in ranks.rank_data) and len(ranks.rank_data) == 6
    assert len(first) == 2 and first[0]["data_seed"] != first[1]["data_seed"]


def test_the_students_copy_leaves_step_times_to_the_submission():
    """The copy replays stored expectations and has no reference to launch: no ranks run, the points wait."""
    ranks = FakeRanks([], [])
    ranks.store = types.SimpleNamespace(mode="replay")
    with pytest.raises(pytest.skip.Exception, match="awarded on submission"):
        grade_step_time(ranks, None, None, 2, (), THRESHOLD, "case", rtol=1e-3)
    assert ranks.order == []
