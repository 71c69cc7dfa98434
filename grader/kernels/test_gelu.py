"""Grading kernels.gelu: the tanh approximation of GeLU, elementwise, in Triton."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_raises
from grader.checks.marks import bf16_gpu_only, drawn_dtypes, gpu_only
from grader.checks.profiles import examples
from grader.checks.strategies import TensorCase, dims, leading_shapes, size_scale, tensor_cases
from grader.kernels.dtype_cases import check_case
from grader.kernels.speed_cases import SPEEDS
from grader.session.context import current
from grader.speed.grading import grade_speed

PROBLEM = BY_ID["kernels.gelu"]

# bf16 only where it is graded at all: on a GPU.
EXTREME_DTYPES = drawn_dtypes(torch.float32, torch.float16)


def shapes(max_last: int, max_leading: int = 12) -> st.SearchStrategy[tuple[int, ...]]:
    """0-d shapes, and shapes of 1 to 3 dims whose last dim is drawn near the usual power-of-two block sizes, so
    that the element count is often one more or one less than a multiple of a block."""
    tiles = (16, 32, 64, 128, 256, 512, 1024)
    with_dims = st.tuples(leading_shapes(max_leading), dims(max_last, tiles=tiles)).map(
        lambda parts: (*parts[0], parts[1])
    )
    return st.one_of(st.just(()), with_dims)


def floor_ulps_of_input_scale(x: torch.Tensor, expected64: torch.Tensor) -> float:
    """The registry's floor, taken relative to max|x| and expressed in ulps of max|gelu(x)| (assert_close's scale).

    0.5 * x * (1 + tanh(u)) cancels for negative x: a faithful float32 evaluation errs by about eps * |x| even
    where gelu(x) is near 0 (torch's own float32 GeLU does), so a tensor of negative values would fail a floor
    relative to its outputs.
    """
    finite = torch.isfinite(expected64)  # a float16 input can round to inf; its output is not compared
    output_scale = float(expected64[finite].abs().max()) if finite.any() else 0.0
    input_scale = float(x[finite].abs().max()) if finite.any() else 0.0
    if output_scale == 0.0:
        return PROBLEM.floor_ulps  # every output is 0 in float64: no floor is added, whatever its size
    return PROBLEM.floor_ulps * max(1.0, input_scale / output_scale)


def check(student, reference, case: TensorCase) -> None:
    check_case(student, reference, case, PROBLEM, "gelu", floor_ulps_of_input_scale, "ulp of max|x|")


@examples(PROBLEM)
# Empty tensors, whatever dim is 0, give empty outputs of the same shape; a 0-d tensor gives a 0-d output.
@example(case=TensorCase((0,), torch.float32))
@example(case=TensorCase((3, 0, 2), torch.float32))
@example(case=TensorCase((), torch.float32))
# Non-contiguous layouts the contract names, where flat indexing of the storage goes wrong; a transposed input, whose
# strides torch.empty_like keeps, where the output must still be a new contiguous tensor.
@example(case=TensorCase((4, 37), torch.float32, "row_padded", "normal", 1))
@example(case=TensorCase((4, 37), torch.float32, "expanded", "normal", 2))
@example(case=TensorCase((4, 37), torch.float32, "transposed", "normal", 4))
# More elements than one block of any usual size: a grid of several programs, at every profile.
@example(case=TensorCase((5, 1000), torch.float32, "contiguous", "normal", 3))
@given(case=tensor_cases(shapes(1100 * size_scale()), torch.float32, regimes=("normal", "ties")))
def test_matches_reference_fp32(student, reference, case):
    check(student, reference, case)


@examples(PROBLEM)
@given(case=tensor_cases(shapes(1100 * size_scale()), torch.float16, regimes=("normal", "ties")))
def test_matches_reference_fp16(student, reference, case):
    check(student, reference, case)


@bf16_gpu_only
@examples(PROBLEM)
@given(case=tensor_cases(shapes(1100 * size_scale()), torch.bfloat16, regimes=("normal", "ties")))
def test_matches_reference_bf16(student, reference, case):
    check(student, reference, case)


@examples(PROBLEM, 0.5)
@given(
    case=st.sampled_from(EXTREME_DTYPES).flatmap(
        lambda dtype: tensor_cases(shapes(300 * size_scale()), dtype, regimes=("large", "tiny"))
    )
)
def test_extreme_values(student, reference, case):
    """Magnitudes up to about 4e4 (x**3 near 1e14; e**(2u) overflows float32 once x > 10) and about 1e-3."""
    check(student, reference, case)


INVALID = [
    pytest.param(lambda device: torch.ones(3, 4, dtype=torch.int32, device=device), id="int32"),
    pytest.param(lambda device: torch.ones(3, 4, dtype=torch.float64, device=device), id="float64"),
    pytest.param(lambda device: torch.tensor(1, device=device), id="zero-dim-int64"),
    pytest.param(lambda device: torch.ones(5, dtype=torch.bool, device=device), id="bool"),
]


@pytest.mark.parametrize("make_input", INVALID)
def test_invalid_arguments(student, make_input):
    x = make_input(current().device)
    assert_raises(student.raises("gelu", x), "TypeError", f"gelu(x) for x of shape {tuple(x.shape)} and {x.dtype}")


@gpu_only
@pytest.mark.parametrize("case", PROBLEM.speed.cases(), ids=str)
def test_speed(student, reference, partial_credit, case):
    grade_speed(SPEEDS[PROBLEM.id], student, reference, case, PROBLEM.speed, partial_credit)
