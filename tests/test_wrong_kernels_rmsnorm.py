"""The grader fails each deliberately wrong kernels.rmsnorm, and its message names the fault.

Each variant in tests/wrong/kernels_rmsnorm/ is a plausible student RMSNorm with one bug. Each run selects only the
test that bug must fail, so the whole module stays short under Triton's interpreter.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "kernels.rmsnorm"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("eps_outside_sqrt", "forward_fp32", "rmsnorm(x, weight, eps)", "out of tolerance"),
    # float16 x^2 overflows for the "large" values (|x| ~ 1e4): the mean square is inf and y is 0.
    case("fp16_statistics", "forward_fp16", "rmsnorm(x, weight, eps)", "dtype=float16", "got 0"),
    # Only the rows-are-not-adjacent layout tells a row stride from the row length.
    case("ignores_row_stride", "forward_fp32", "rmsnorm(x, weight, eps)", "out of tolerance", "layout=row_padded"),
    case("dweight_one_block", "backward_fp32", "gradient of weight", "out of tolerance"),
    case("dx_rstd_constant", "backward_fp32", "gradient of x"),
    case("dx_without_weight", "backward_fp32", "gradient of x", "out of tolerance"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_rmsnorm(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"kernels_rmsnorm and {test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
