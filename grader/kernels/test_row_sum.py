"""Grading kernels.row_sum: the sum over the last dimension, in Triton."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.marks import bf16_gpu_only, drawn_dtypes, gpu_only
from grader.checks.profiles import examples
from grader.checks.strategies import TensorCase, dims, leading_shapes, long_lengths, size_scale, tensor_cases
from grader.kernels.dtype_cases import ROWS_INVALID, check_case, check_refuses_rows
from grader.kernels.speed_cases import SPEEDS
from grader.speed.grading import grade_speed

PROBLEM = BY_ID["kernels.row_sum"]
# float16 and bfloat16, the latter only where it is graded at all: on a GPU.
LOW_PRECISION_DTYPES = drawn_dtypes(torch.float16)

# Sums of 1e4-magnitude values overflow float16 (max 65504) after a few dozen elements.
LOW_PRECISION_REGIMES = ("normal", "ties", "tiny")


def row_shapes(max_cols: int, max_rows: int = 12) -> st.SearchStrategy[tuple[int, ...]]:
    return st.tuples(leading_shapes(max_rows), dims(max_cols)).map(lambda parts: (*parts[0], parts[1]))


def floor_ulps_of_abs_sums(x: torch.Tensor, expected64: torch.Tensor) -> float:
    """The registry's floor in float32 ulps of the largest sum of |x| over a row, or in ulps of x's dtype at the
    largest |row sum| if that is more, expressed in ulps of x's dtype at the largest |row sum| (assert_close's scale).

    A float32 sum in any order errs by a few float32 eps times the sum of the magnitudes it adds, not of the result:
    a row whose terms cancel (a sum near 0) would otherwise demand that the student add in the reference's order.
    The contract's accumulator is float32 whatever the input dtype, so the term stays in float32 eps for float16
    and bfloat16 rows too: in their own eps it would admit a float16 accumulator.
    """
    output_scale = float(expected64.abs().max()) if expected64.numel() else 0.0
    if output_scale == 0.0:
        return PROBLEM.floor_ulps  # every row sums to 0 in float64: no floor is added, whatever its size
    abs_sum_scale = float(x.double().cpu().abs().sum(dim=-1).max())
    float32_ulps = torch.finfo(torch.float32).eps / torch.finfo(x.dtype).eps
    return PROBLEM.floor_ulps * max(1.0, float32_ulps * abs_sum_scale / output_scale)


def check(student, reference, case: TensorCase) -> None:
    check_case(student, reference, case, PROBLEM, "row_sum", floor_ulps_of_abs_sums,
               "float32 ulp of the largest row sum of |x|")


@examples(PROBLEM)
# A leading dim of size 0: the contract's empty output, in every profile.
@example(case=TensorCase((0, 5), torch.float32))
@example(case=TensorCase((2, 0, 7), torch.float32))
# The layouts the contract names that assume-adjacent-rows code gets wrong: rows of a wider tensor, rows broadcast.
@example(case=TensorCase((4, 37), torch.float32, "row_padded", "normal", 1))
@example(case=TensorCase((4, 37), torch.float32, "expanded", "normal", 2))
@given(case=tensor_cases(row_shapes(160 * size_scale()), torch.float32))
def test_matches_reference_fp32(student, reference, case):
    check(student, reference, case)


@examples(PROBLEM)
@given(case=tensor_cases(row_shapes(160 * size_scale()), torch.float16, regimes=LOW_PRECISION_REGIMES))
def test_matches_reference_fp16(student, reference, case):
    check(student, reference, case)


@bf16_gpu_only
@examples(PROBLEM)
@given(case=tensor_cases(row_shapes(160 * size_scale()), torch.bfloat16, regimes=LOW_PRECISION_REGIMES))
def test_matches_reference_bf16(student, reference, case):
    check(student, reference, case)


@examples(PROBLEM, 0.5)
@given(
    case=tensor_cases(
        # 10k to 40k columns under `ci`, 160k and more on a GPU: many blocks, and almost never a whole number of them.
        st.tuples(leading_shapes(3, max_dims=2), long_lengths(10_000 * size_scale(), 40_000 * size_scale())).map(
            lambda parts: (*parts[0], parts[1])
        ),
        torch.float32,
        regimes=("normal", "large"),
    )
)
def test_long_rows(student, reference, case):
    """Rows far longer than one block: 100k+ columns on a GPU (fewer under the interpreter)."""
    check(student, reference, case)


@examples(PROBLEM, 0.5)
@given(
    case=tensor_cases(
        # Rows several blocks long (a block of 4,096 lanes at most): each lane adds enough "cancelling" terms for its
        # running sum to pass 2048, float16's last exact integer.
        st.tuples(st.integers(1, 2), long_lengths(20_000 * size_scale(), 40_000 * size_scale())),
        st.sampled_from(LOW_PRECISION_DTYPES),
        layouts=("contiguous",),
        regimes=("cancelling",),
    )
)
def test_float32_accumulator(student, reference, case):
    """float16 and bfloat16 rows are summed in float32, as the contract says: exactly, for these integers."""
    check(student, reference, case)


@pytest.mark.parametrize("make_input, expected_error", ROWS_INVALID)
def test_invalid_arguments(student, make_input, expected_error):
    check_refuses_rows(student, "row_sum", make_input, expected_error)


@gpu_only
@pytest.mark.parametrize("case", PROBLEM.speed.cases(), ids=str)
def test_speed(student, reference, partial_credit, case):
    grade_speed(SPEEDS[PROBLEM.id], student, reference, case, PROBLEM.speed, partial_credit)
