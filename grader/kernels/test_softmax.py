"""Grading kernels.softmax: softmax over the last dimension, in Triton."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.marks import bf16_gpu_only, gpu_only
from grader.checks.profiles import examples
from grader.checks.strategies import TensorCase, dims, leading_shapes, long_lengths, size_scale, tensor_cases
from grader.kernels.dtype_cases import ROWS_INVALID, check_case, check_refuses_rows
from grader.kernels.speed_cases import SPEEDS
from grader.speed.grading import grade_speed

PROBLEM = BY_ID["kernels.softmax"]


def row_shapes(max_cols: int, max_rows: int = 12) -> st.SearchStrategy[tuple[int, ...]]:
    # Tiles of the usual power-of-two block sizes, so that n = block +- 1 is drawn often.
    return st.tuples(leading_shapes(max_rows), dims(max_cols, tiles=(16, 32, 64, 128, 256, 512, 1024))).map(
        lambda parts: (*parts[0], parts[1])
    )


def check(student, reference, case: TensorCase) -> None:
    check_case(student, reference, case, PROBLEM, "softmax")


@examples(PROBLEM)
# A leading dim of size 0: the contract's empty output, in every profile.
@example(case=TensorCase((0, 5), torch.float32))
@example(case=TensorCase((2, 0, 7), torch.float32))
# The layouts the contract names that assume-adjacent-rows code gets wrong: rows of a wider tensor, rows broadcast.
@example(case=TensorCase((4, 37), torch.float32, "row_padded", "normal", 1))
@example(case=TensorCase((4, 37), torch.float32, "expanded", "normal", 2))
@given(case=tensor_cases(row_shapes(96 * size_scale()), torch.float32))
def test_matches_reference_fp32(student, reference, case):
    check(student, reference, case)


@examples(PROBLEM)
@given(case=tensor_cases(row_shapes(96 * size_scale()), torch.float16, regimes=("normal", "ties", "tiny")))
def test_matches_reference_fp16(student, reference, case):
    check(student, reference, case)


@bf16_gpu_only
@examples(PROBLEM)
@given(case=tensor_cases(row_shapes(96 * size_scale()), torch.bfloat16, regimes=("normal", "ties", "tiny")))
def test_matches_reference_bf16(student, reference, case):
    check(student, reference, case)


@examples(PROBLEM, 0.25)
@given(
    case=tensor_cases(
        # Up to 40k columns under `ci` (past the reference's 16k single-pass limit too), 100k+ on a GPU.
        st.tuples(st.integers(1, 2), long_lengths(5_000 * size_scale(), 40_000 * size_scale())),
        torch.float32,
        layouts=("contiguous", "sliced", "row_padded"),
        regimes=("normal", "large"),
    )
)
def test_long_rows(student, reference, case):
    """Rows far longer than one block: 100k columns on a GPU (fewer under the interpreter)."""
    check(student, reference, case)


@examples(PROBLEM, 0.5)
@given(case=tensor_cases(row_shapes(96 * size_scale()), torch.float32, regimes=("large",)))
def test_large_magnitudes(student, reference, case):
    """Inputs of magnitude 1e4: exp overflows unless the row maximum is subtracted first."""
    check(student, reference, case)


@pytest.mark.parametrize("make_input, expected_error", ROWS_INVALID)
def test_invalid_arguments(student, make_input, expected_error):
    check_refuses_rows(student, "softmax", make_input, expected_error)


@gpu_only
@pytest.mark.parametrize("case", PROBLEM.speed.cases(), ids=str)
def test_speed(student, reference, partial_credit, case):
    grade_speed(SPEEDS[PROBLEM.id], student, reference, case, PROBLEM.speed, partial_credit)
