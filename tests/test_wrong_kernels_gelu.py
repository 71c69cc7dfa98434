"""The grader fails each deliberately wrong kernels.gelu, and its message names the fault.

Each variant in tests/wrong/kernels_gelu/ is a plausible student GeLU with one bug. Each run selects only the test
that bug must fail, so the whole module stays short under Triton's interpreter.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "kernels.gelu"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    # The exact GeLU is off the tanh approximation by up to 5e-4, hundreds of times the float32 tolerance.
    case("erf_instead_of_tanh", "matches_reference_fp32", "out of tolerance", "dtype=float32"),
    case("naive_tanh_overflows", "extreme_values", "non-finite", "nan", "values=large"),
    case(
        "unmasked_tail", "matches_reference_fp32",
        "TritonOutOfBounds", "out-of-bounds load in Triton kernel `_gelu_kernel`", "past the end of `x_ptr`",
    ),
    # Reading a view with stride 2 as if it were contiguous stays inside its storage but picks the wrong elements.
    case("ignores_strides", "matches_reference_fp32", "out of tolerance", "layout=sliced"),
    case("computes_in_fp16", "matches_reference_fp32", "out of tolerance", "dtype=float32"),
    case("calls_torch_gelu", "matches_reference_fp32", "called aten.gelu"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_gelu(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"kernels_gelu and {test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
