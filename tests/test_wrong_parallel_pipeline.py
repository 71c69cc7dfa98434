"""The grader fails each deliberately wrong parallel.pipeline, and its message names the fault.

Each variant in tests/wrong/parallel_pipeline/ is a plausible student pipeline with one bug; each run selects only
the test that bug must fail.
"""

from __future__ import annotations

import uuid

import pytest

from assignment.registry import BY_ID
from tests.grading import assert_fails_for, processes_with, run_grader, wrong_impl

PROBLEM = "parallel.pipeline"

CASES = [
    pytest.param("loss_not_scaled", "gpipe_matches_single_process[2]",
                 ("gradient after step 1 of the stage's parameter", "out of tolerance"), id="loss_not_scaled"),
    pytest.param("loss_scaled_twice", "one_f_one_b_matches_single_process[2]",
                 ("gradient after step 1 of the stage's parameter", "out of tolerance"), id="loss_scaled_twice"),
    pytest.param("too_many_warmup", "one_f_one_b_order[4]",
                 ("micro-batches in flight", "1F1B allows at most p - s"), id="too_many_warmup"),
    pytest.param("gpipe_one_at_a_time", "gpipe_order[2]",
                 ("forward/backward order FBFB", "for schedule 'gpipe'"), id="gpipe_one_at_a_time"),
    pytest.param("bubble_over_m", "bubble_fraction", ("expected (p - 1) / (m + p - 1)",), id="bubble_over_m"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_pipeline(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"parallel_pipeline and {test}")
    assert_fails_for(run, PROBLEM, test, *fragments)


# The launcher's deadline ends the deadlock; scaled down so the test waits seconds, not the problem's full call limit.
TIMEOUT_SCALE = 0.2


def test_blocking_sends_deadlock_in_1f1b_and_time_out():
    marker = f"PIPELINE_HANG_TEST={uuid.uuid4().hex}"
    name, _, value = marker.partition("=")
    test = "one_f_one_b_matches_single_process[2]"
    run = run_grader(wrong_impl(PROBLEM, "blocking_sends"), "-k", f"parallel_pipeline and {test}",
                     "--timeout-scale", str(TIMEOUT_SCALE), env={name: value})
    limit_s = BY_ID[PROBLEM].call_timeout_s * TIMEOUT_SCALE
    # Both stages wait in a send (on gloo, torch's send runs through isend, which the progress file may name).
    assert_fails_for(run, PROBLEM, test, f"did not finish within {limit_s:.0f} s",
                     "rank(s) [0, 1] waited in collective", status="timed out")
    assert processes_with(marker) == [], "rank processes outlived the grader run"
