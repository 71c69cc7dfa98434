"""Grading kernels.matmul: C = A @ B in Triton, with an optional fused tanh-GeLU epilogue.

A and B are drawn with independent layouts (contiguous, transposed, sliced, offset) and sizes that straddle the usual
tile sizes. The student's C is measured against the plain reference in float64 on the same inputs, with the fast
reference's own error at the test dtype as the yardstick; its float32 path is full float32 (no TF32).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_close, assert_contiguous, assert_raises
from grader.checks.marks import bf16_gpu_only, drawn_dtypes, gpu_only
from grader.checks.outcomes import RuleViolation
from grader.checks.profiles import examples
from grader.checks.strategies import LAYOUTS, REGIMES, TensorCase, dims, size_scale
from grader.kernels.speed_cases import SPEEDS
from grader.session.context import current
from grader.speed.grading import grade_speed

PROBLEM = BY_ID["kernels.matmul"]

# Value regimes per dtype. float16 tops out at 65504, so products of "large" values (about 1e8) overflow it.
REGIMES_BY_DTYPE = {
    torch.float32: REGIMES,
    torch.float16: ("normal", "ties", "tiny"),
    torch.bfloat16: REGIMES,
}
# Tile sizes that M, N and K are drawn around (each +-1).
TILES = (16, 32, 64, 128)
# The dtypes a test may draw: bfloat16 only on a GPU (the interpreter's bfloat16 arithmetic is wrong).
DRAWN_DTYPES = drawn_dtypes(torch.float32, torch.float16)
LOW_PRECISION_DTYPES = drawn_dtypes(torch.float16)


@dataclass(frozen=True)
class MatmulCase:
    """A [M, K] and B [K, N], each with its own layout and seed, and one value regime for both."""

    a: TensorCase
    b: TensorCase

    def make(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a.make(device), self.b.make(device)

    def describe(self) -> str:
        return f"a: {self.a.describe()}; b: {self.b.describe()}"


def side(max_size: int) -> st.SearchStrategy[int]:
    return dims(max_size, tiles=TILES)


@st.composite
def matmul_cases(draw, sizes_mnk: st.SearchStrategy[tuple[int, int, int]], dtypes: tuple[torch.dtype, ...]):
    m, n, k = draw(sizes_mnk)
    dtype = draw(st.sampled_from(dtypes))
    regime = draw(st.sampled_from(REGIMES_BY_DTYPE[dtype]))
    seeds = st.integers(0, 2**31 - 1)
    a = TensorCase((m, k), dtype, draw(st.sampled_from(LAYOUTS)), regime, draw(seeds))
    b = TensorCase((k, n), dtype, draw(st.sampled_from(LAYOUTS)), regime, draw(seeds))
    return MatmulCase(a, b)


def any_sizes() -> st.SearchStrategy[tuple[int, int, int]]:
    largest = 70 * size_scale()
    return st.tuples(side(largest), side(largest), side(largest))


def k_remainder_sizes() -> st.SearchStrategy[tuple[int, int, int]]:
    # K = 64 j + r with r odd: at least one whole block of any power-of-two BLOCK_K <= 64, then a partial one.
    full_blocks = st.integers(1, 4 * size_scale())
    odd_remainder = st.integers(0, 31).map(lambda i: 2 * i + 1)
    k = st.tuples(full_blocks, odd_remainder).map(lambda parts: 64 * parts[0] + parts[1])
    largest = 40 * size_scale()
    return st.tuples(side(largest), side(largest), k)


def check(student, reference, case: MatmulCase | AccumulationCase, activation: str | None = None) -> None:
    a, b = case.make(current().device)
    kwargs = {} if activation is None else {"activation": activation}
    with student.describing(case.describe()):
        reply, (expected64, at_dtype) = student.call_beside(
            lambda: (reference.matmul_torch(a.double(), b.double(), activation), reference.matmul(a, b, activation)),
            "matmul", a, b, **kwargs)
    actual = reply["value"]
    if len(reply["launches"]) != 1:
        raise RuleViolation(f"matmul(a, b{'' if activation is None else ', activation=' + repr(activation)}) launched "
                            f"{len(reply['launches'])} Triton kernels ({', '.join(reply['launches'])}): the contract "
                            f"is one launch per call, with the GeLU fused into its epilogue ({case.describe()})")
    assert_contiguous(actual, "matmul(a, b)", case.describe())
    assert_close(
        actual,
        expected64,
        at_dtype,
        what="matmul(a, b)" if activation is None else f"matmul(a, b, activation={activation!r})",
        context=case.describe(),
        multiple=PROBLEM.error_multiple,
        floor_ulps=PROBLEM.floor_ulps,
    )


@examples(PROBLEM)
@given(case=matmul_cases(any_sizes(), (torch.float32,)))
def test_matches_reference_fp32(student, reference, case):
    """float32 in full float32 precision: a TF32 product is far outside the tolerance."""
    check(student, reference, case)


@examples(PROBLEM)
@given(case=matmul_cases(any_sizes(), (torch.float16,)))
def test_matches_reference_fp16(student, reference, case):
    check(student, reference, case)


@bf16_gpu_only
@examples(PROBLEM)
@given(case=matmul_cases(any_sizes(), (torch.bfloat16,)))
def test_matches_reference_bf16(student, reference, case):
    check(student, reference, case)


@examples(PROBLEM)
@given(case=matmul_cases(k_remainder_sizes(), DRAWN_DTYPES))
def test_k_remainder(student, reference, case):
    """K is several blocks long and ends in a partial block of odd length."""
    check(student, reference, case)


@examples(PROBLEM)
@given(case=matmul_cases(any_sizes(), DRAWN_DTYPES))
def test_gelu_epilogue(student, reference, case):
    """activation="gelu": the tanh GeLU of the float32 accumulator, rounded once."""
    check(student, reference, case, activation="gelu")


@dataclass(frozen=True)
class AccumulationCase:
    """Small-integer A and B whose products all add up along the first half of K and cancel along the second: the
    running sum of every output climbs to about 1.1 K before it falls back to a small result. Every partial sum is an
    integer well inside float32's exact range, so a float32 accumulator is exact and the one rounding at the store is
    exact too; a 16-bit accumulator rounds each partial sum beyond 2048 (float16) or 256 (bfloat16) to a multiple of
    2, 4 or 8 and is off by several units."""

    m: int
    n: int
    k: int
    dtype: torch.dtype
    seed: int

    def make(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        a = torch.randint(1, 3, (self.m, self.k), generator=generator)
        b = torch.randint(1, 3, (self.k, self.n), generator=generator)
        b[self.k // 2:] *= -1
        return a.to(self.dtype).to(device), b.to(self.dtype).to(device)

    def describe(self) -> str:
        return (f"a: shape=({self.m}, {self.k}), b: shape=({self.k}, {self.n}), dtype="
                f"{str(self.dtype).removeprefix('torch.')}, values: integers 1 and 2, b negated from row K/2 on, "
                f"seed={self.seed}")


def accumulation_cases() -> st.SearchStrategy[AccumulationCase]:
    # K = 64 j + r between 3,000 and 4,200: the running sums pass 3,000; M and N stay small for the interpreter.
    k = st.tuples(st.integers(47, 64), st.integers(0, 63)).map(lambda parts: 64 * parts[0] + parts[1])
    return st.builds(AccumulationCase, m=side(20), n=side(20), k=k, dtype=st.sampled_from(LOW_PRECISION_DTYPES),
                     seed=st.integers(0, 2**31 - 1))


@examples(PROBLEM, 0.5)
@given(case=accumulation_cases())
def test_float32_accumulator(student, reference, case):
    """float16 and bfloat16 inputs are summed in a float32 accumulator, as the contract says: here its result is
    exact, and a 16-bit accumulator's is not."""
    check(student, reference, case)


def _ones(*shape: int, dtype: torch.dtype = torch.float32):
    return lambda device: torch.ones(shape, dtype=dtype, device=device)


INVALID = [
    pytest.param(lambda d: [[1.0, 2.0]], _ones(2, 3), {}, "TypeError", id="a-not-a-tensor"),
    pytest.param(_ones(3, 4, dtype=torch.int32), _ones(4, 2, dtype=torch.int32), {}, "TypeError", id="int32"),
    pytest.param(_ones(3, 4, dtype=torch.float64), _ones(4, 2, dtype=torch.float64), {}, "TypeError", id="float64"),
    pytest.param(_ones(3, 4), _ones(4, 2, dtype=torch.float16), {}, "TypeError", id="mixed-dtypes"),
    pytest.param(_ones(2, 3, 4), _ones(4, 5), {}, "ValueError", id="three-dim-a"),
    pytest.param(_ones(4), _ones(4, 5), {}, "ValueError", id="one-dim-a"),
    pytest.param(_ones(3, 4), _ones(5, 2), {}, "ValueError", id="inner-dims-differ"),
    pytest.param(_ones(0, 4), _ones(4, 2), {}, "ValueError", id="m-zero"),
    pytest.param(_ones(3, 0), _ones(0, 2), {}, "ValueError", id="k-zero"),
    pytest.param(_ones(3, 4), _ones(4, 2), {"activation": "relu"}, "ValueError", id="unknown-activation"),
    pytest.param(_ones(3, 4), _ones(4, 2), {"activation": "GELU"}, "ValueError", id="activation-case"),
]


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} and {x.dtype}"
    return f"a {type(x).__name__}"


@pytest.mark.parametrize("make_a, make_b, kwargs, expected_error", INVALID)
def test_invalid_arguments(student, make_a, make_b, kwargs, expected_error):
    device = current().device
    a, b = make_a(device), make_b(device)
    options = "".join(f", {name}={value!r}" for name, value in kwargs.items())
    assert_raises(student.raises("matmul", a, b, **kwargs), expected_error,
                  f"matmul(a, b{options}) for a = {_describe(a)} and b = {_describe(b)}")


@gpu_only
@pytest.mark.parametrize("case", PROBLEM.speed.cases(), ids=str)
def test_speed(student, reference, partial_credit, case):
    grade_speed(SPEEDS[PROBLEM.id], student, reference, case, PROBLEM.speed, partial_credit)
