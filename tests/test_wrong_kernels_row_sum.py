"""The grader fails each deliberately wrong kernels.row_sum, and its message names the fault.

Each variant in tests/wrong/kernels_row_sum/ is a plausible student row sum with one bug. Each run selects only the
test that bug must fail, so the whole module stays short under Triton's interpreter.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "kernels.row_sum"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("drops_last_block", "long_rows", "out of tolerance"),
    case("sums_first_block_only", "long_rows", "out of tolerance"),
    case(
        "reads_past_row_end", "long_rows",
        "TritonOutOfBounds", "out-of-bounds load in Triton kernel `_row_sum_long_kernel`", "past the end of `x_ptr`",
    ),
    # Caught on float32 inputs, which lose their low bits in float16. On float16 inputs a float16 sum of blocks stays
    # within the calibrated tolerance: its rounding errors are a few ulp of the result, like the output's own.
    case("fp16_accumulation", "matches_reference_fp32", "out of tolerance", "dtype=float32"),
    case("keeps_reduced_dim", "matches_reference_fp32", "wrong shape"),
    case("calls_torch_sum", "matches_reference_fp32", "called aten.sum"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_row_sum(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"kernels_row_sum and {test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
