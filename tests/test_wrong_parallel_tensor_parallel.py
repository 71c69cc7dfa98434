"""The grader fails each deliberately wrong parallel.tensor_parallel, and its message names the fault.

Each variant in tests/wrong/parallel_tensor_parallel/ is a plausible student implementation with one bug. Each run
selects only the 2-rank test that bug must fail: a rank launch costs seconds.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "parallel.tensor_parallel"


def case(variant: str, test: str, *fragments: str):
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("row_bias_every_rank", "row_parallel_linear[2]", "output:", "out of tolerance", "bias=True"),
    case("column_no_backward_all_reduce", "column_parallel_linear[2]", "input gradient", "out of tolerance"),
    case("attention_splits_head_dim", "attention_matches_single_rank[2]", "output:", "out of tolerance",
         "attention, H=2 heads"),
    case("mlp_all_reduce_between_linears", "mlp_matches_single_rank[2]", "output:", "out of tolerance", "mlp"),
    # Values stay right (the averaged gradients are equal already); only the count of all-reduces shows the bug.
    case("row_backward_averages", "collective_pattern[2]", "issued the collectives",
         "all_reduce of 16 bytes in backward", "of the row layer"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_tensor_parallel(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"parallel_tensor_parallel and {test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
