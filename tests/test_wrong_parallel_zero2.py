"""The grader fails each deliberately wrong parallel.zero2, and its message names the fault.

Each variant in tests/wrong/parallel_zero2/ is a plausible student implementation with one bug. Each run
selects only the 2-rank test that bug must fail.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "parallel.zero2"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for `variant`, its output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("all_reduce_full_gradients", "gradients_sharded[2]", "which it does not own, to None"),
    case("keeps_unowned_gradients", "gradients_sharded[2]", "which it does not own, to None"),
    case("sums_gradients", "matches_single_process[2]", "gradient of", "on its owner after step 1", "out of tolerance"),
    case("reduces_after_backward", "collective_pattern[2]", "issued after backward returned"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_zero2(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"parallel_zero2 and {test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
