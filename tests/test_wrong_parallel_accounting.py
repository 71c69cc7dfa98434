"""The grader fails each deliberately wrong parallel.accounting, and its message names the fault."""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "parallel.accounting"


def case(variant: str, test: str, *fragments: str):
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("zero2_unsharded_gradients", "bytes_per_parameter", "bytes_per_parameter('zero2'", ".gradients = 2.0"),
    case("all_reduce_volume_2b", "communication_volume", "communication_volume('all_reduce'", "expected"),
    case("sequence_parallel_drops_replicated_terms", "sequence_parallel_activations",
         "sequence_parallel=True).", "exactly"),
    case("heads_not_checked", "invalid_arguments[heads-not-split]", "tensor_parallel=3", "must raise ValueError",
         "returned normally"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_accounting(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"parallel_accounting and test_{test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
