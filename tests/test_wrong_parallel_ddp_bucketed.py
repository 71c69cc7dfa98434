"""The grader fails each deliberately wrong parallel.ddp_bucketed, and its message names the fault.

Each variant in tests/wrong/parallel_ddp_bucketed/ is a plausible student implementation with one bug. Each run
selects only the 2-rank test that bug must fail.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "parallel.ddp_bucketed"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for `variant`, its output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("sums_gradients", "matches_single_process[2]", "gradient after step 1", "out of tolerance"),
    case("bucket_per_parameter", "bucket_partition[2]", "the pinned buckets are", "one all-reduce per bucket"),
    case("buckets_in_forward_order", "bucket_partition[2]", "the pinned buckets are", "reverse parameter order"),
    case("issues_all_at_end_of_backward", "overlaps_backward[2]", "had finished the last layer",
         "as soon as its last gradient is ready"),
    case("all_reduces_after_backward", "overlaps_backward[2]", "issued after backward returned"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_ddp_bucketed(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"parallel_ddp_bucketed and {test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
