"""The grader fails each deliberately wrong parallel.zero1, and its message names the fault.

Each variant in tests/wrong/parallel_zero1/ is a plausible student implementation with one bug. Each run
selects only the test that bug must fail.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "parallel.zero1"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for `variant`, its output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("no_broadcast", "matches_unsharded[2]", "owned by rank 1", "after step 1", "out of tolerance"),
    case("full_state", "state_sharded[2]", "bytes of state", "it keeps the full state"),
    case("round_robin_partition", "state_sharded[2]", "the pinned partition gives it"),
    case("broadcast_from_group_rank", "process_group[4]", "of 4 raised", "not part of group"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_zero1(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"parallel_zero1 and {test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
