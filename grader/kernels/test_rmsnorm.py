"""Grading kernels.rmsnorm: RMSNorm over the last dimension in Triton, forward and backward.

Outputs are compared with a float64 evaluation of the plain formula, the tolerance calibrated by the fast reference's
error at the same dtype. The gradients' error floors scale with the terms a backward pass sums, not with the result:
dx of a row with D = 1 is a near-total cancellation, and dweight sums terms of random sign over many rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_close, assert_contiguous, assert_raises, check_tensor_form
from grader.checks.marks import bf16_gpu_only, gpu_only
from grader.checks.outcomes import WrongAnswer
from grader.checks.profiles import examples
from grader.checks.strategies import ALL_LAYOUTS, REGIMES, TensorCase, dims, long_lengths, size_scale
from grader.kernels.speed_cases import SPEEDS
from grader.session.context import current
from grader.speed.grading import grade_speed

PROBLEM = BY_ID["kernels.rmsnorm"]

DEFAULT_EPS = 1e-6
# eps moves the result by about eps / mean(x^2) relative: visibly for the "tiny" regime (mean square 1e-6) at every
# eps drawn, and for unit-scale values at the larger ones.
EPSILONS = (DEFAULT_EPS, 1e-5, 1e-2, 1.0)
WEIGHT_LAYOUTS = ("contiguous", "sliced")


@dataclass(frozen=True)
class NormCase:
    shape: tuple[int, ...]
    dtype: torch.dtype
    x_layout: str
    weight_layout: str
    regime: str
    eps: float
    seed: int
    upstream_layout: str = "contiguous"  # of the backward's grad_y, which "may have any strides"

    def x(self, device) -> torch.Tensor:
        return TensorCase(self.shape, self.dtype, self.x_layout, self.regime, self.seed).make(device)

    def weight(self, device) -> torch.Tensor:
        return TensorCase(self.shape[-1:], self.dtype, self.weight_layout, "normal", self.seed + 1).make(device)

    def upstream(self, device) -> torch.Tensor:
        return TensorCase(self.shape, self.dtype, self.upstream_layout, "normal", self.seed + 2).make(device)

    def describe(self) -> str:
        return (
            f"x shape={self.shape}, dtype={str(self.dtype).removeprefix('torch.')}, layout={self.x_layout}, "
            f"values={self.regime}; weight layout={self.weight_layout}; eps={self.eps:g}; seed={self.seed}; "
            f"grad_y layout={self.upstream_layout}"
        )


def leading_dims(max_rows: int) -> st.SearchStrategy[tuple[int, ...]]:
    """No leading dim, one (of up to max_rows rows), or two."""
    return st.one_of(
        st.just(()),
        dims(max_rows).map(lambda rows: (rows,)),
        st.tuples(st.integers(1, 8), dims(max(1, max_rows // 8))),
    )


def shapes(max_rows: int, max_cols: int, long_rows: bool = False) -> st.SearchStrategy[tuple[int, ...]]:
    """Row counts and lengths around the usual tile sizes; with long_rows, one draw in four is a few rows of more
    than 8192 columns, past what a kernel holds in registers at once (several times that on a GPU)."""
    short = st.tuples(leading_dims(max_rows), dims(max_cols, tiles=(16, 32, 64, 128, 256, 512, 1024)))
    short = short.map(lambda parts: (*parts[0], parts[1]))
    if not long_rows:
        return short
    long = st.tuples(st.integers(1, 3), long_lengths(8_193, 20_000 * size_scale()))
    return st.integers(0, 3).flatmap(lambda draw: long if draw == 3 else short)


def norm_cases(shape_strategy, dtype: torch.dtype, regimes: tuple[str, ...] = REGIMES) -> st.SearchStrategy[NormCase]:
    return st.builds(
        NormCase,
        shape=shape_strategy,
        dtype=st.just(dtype),
        x_layout=st.sampled_from(ALL_LAYOUTS),
        weight_layout=st.sampled_from(WEIGHT_LAYOUTS),
        regime=st.sampled_from(regimes),
        eps=st.sampled_from(EPSILONS),
        seed=st.integers(0, 2**31 - 2),
        upstream_layout=st.sampled_from(ALL_LAYOUTS),
    )


def arguments(case: NormCase, x: torch.Tensor, weight: torch.Tensor) -> tuple:
    """The call's arguments: eps left to its default when the case draws the default."""
    return (x, weight) if case.eps == DEFAULT_EPS else (x, weight, case.eps)


def check_forward(student, reference, case: NormCase) -> None:
    device = current().device
    x, weight = case.x(device), case.weight(device)

    def expected():
        with torch.no_grad():
            exact = reference.rmsnorm_torch(x.double(), weight.double(), case.eps)
            return exact, reference.rmsnorm(x, weight, case.eps)

    with student.describing(case.describe()):
        reply, (expected64, at_dtype) = student.call_beside(expected, "rmsnorm", *arguments(case, x, weight))
    actual = reply["value"]
    what = "rmsnorm(x, weight, eps)"
    check_tensor_form(actual, at_dtype, what, case.describe())
    assert_contiguous(actual, what, case.describe())
    if at_dtype.numel() > 1 and bool((at_dtype == at_dtype.flatten()[0]).all()):
        # D = 1 and rows of one sign: y = w x / sqrt(x^2 + eps) rounds to the same value in every row, so a constant
        # output is right although the float64 one varies in its last digits. assert_close rejects constant
        # outputs; a zero appended to all three tensors keeps this one from looking constant.
        actual, expected64, at_dtype = (torch.cat([t.flatten(), t.new_zeros(1)])
                                        for t in (actual, expected64, at_dtype))
    assert_close(
        actual,
        expected64,
        at_dtype,
        what=what,
        context=case.describe(),
        multiple=PROBLEM.error_multiple,
        floor_ulps=PROBLEM.floor_ulps,
    )


def reference_gradients(rmsnorm, x, weight, eps: float, upstream) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_(True)
    weight = weight.detach().requires_grad_(True)
    rmsnorm(x, weight, eps).backward(upstream)
    return x.grad, weight.grad


def gradient_term_scales(x, weight, eps: float, upstream) -> tuple[float, float]:
    """The largest sum of absolute terms that makes one element of grad_x, and of grad_weight.

    grad_x[r, j] = rstd (gw_j - x_hat_j mean_k(gw_k x_hat_k)) and grad_weight[j] = sum_r g[r, j] x_hat[r, j]; every
    float32 evaluation is uncertain by a few ulps of these sums of absolute values, whatever its order.
    """
    x, weight, upstream = (t.detach().to("cpu", torch.float64) for t in (x, weight, upstream))
    rstd = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    x_hat = x * rstd
    grad_x_hat = upstream * weight
    projection_terms = (grad_x_hat * x_hat).abs().mean(dim=-1, keepdim=True)
    grad_x_terms = rstd * (grad_x_hat.abs() + x_hat.abs() * projection_terms)
    grad_weight_terms = (upstream * x_hat).abs().reshape(-1, x.shape[-1]).sum(dim=0)
    return float(grad_x_terms.max()) if x.numel() else 0.0, float(grad_weight_terms.max())


def check_gradient(actual, exact, expected_at_dtype, term_scale: float, what: str, context: str) -> None:
    """assert_close, with its error floor raised to the scale of the summed terms when that exceeds the result's."""
    if exact.numel() == 0:
        check_tensor_form(actual, expected_at_dtype, what, context)
        return
    result_scale = float(exact.abs().max())
    floor = PROBLEM.floor_ulps * torch.finfo(expected_at_dtype.dtype).eps * term_scale
    if result_scale > floor:
        assert_close(actual, exact, expected_at_dtype, what=what, context=context, multiple=PROBLEM.error_multiple,
                     floor_ulps=PROBLEM.floor_ulps * max(1.0, term_scale / result_scale))
        return
    # The terms cancel almost entirely (D = 1 and |x| >> sqrt(eps): y is about sign(x) * weight, flat in x): the
    # gradient is what is left, zero up to rounding.
    check_tensor_form(actual, expected_at_dtype, what, context)
    error = float((actual.detach().double().cpu() - exact.double().cpu()).abs().max())
    if not error <= floor:
        raise WrongAnswer(f"{what}: expected {result_scale:.3g} at most (the terms cancel here), got an error of "
                          f"{error:.3g}; allowed {floor:.3g} ({context})")


def check_backward(student, reference, case: NormCase) -> None:
    device = current().device
    x, weight, upstream = case.x(device), case.weight(device), case.upstream(device)
    grad = {"inputs": [0, 1], "upstream": [upstream]}

    def expected():
        return (reference_gradients(reference.rmsnorm_torch, x.double(), weight.double(), case.eps, upstream.double()),
                reference_gradients(reference.rmsnorm, x, weight, case.eps, upstream))

    with student.describing(case.describe()):
        reply, (exact, at_dtype) = student.call_beside(expected, "rmsnorm", *arguments(case, x, weight), grad=grad)
    term_scales = gradient_term_scales(x, weight, case.eps, upstream)
    for index, name in enumerate(("x", "weight")):
        what = f"gradient of {name}"
        if reply["grads"][index] is None:
            raise WrongAnswer(f"{what}: {name} received no gradient ({case.describe()})")
        check_gradient(reply["grads"][index], exact[index], at_dtype[index], term_scales[index], what, case.describe())


# No rows (a leading dim of size 0): an empty output, and in the backward an empty grad_x and a zero grad_weight.
EMPTY_CASE = NormCase((0, 8), torch.float32, "contiguous", "contiguous", "normal", DEFAULT_EPS, 0)
# One past 2^13, a length a kernel of 8192-wide blocks must cover in two blocks, and past the rows the reference keeps
# in registers: drawn in every profile (long rows are otherwise one draw in four), with every operand strided.
LONG_ROW_CASE = NormCase((2, 8193), torch.float32, "row_padded", "sliced", "normal", DEFAULT_EPS, 2, "transposed")


@examples(PROBLEM)
@example(case=EMPTY_CASE)
@example(case=LONG_ROW_CASE)
@given(case=norm_cases(shapes(64 * size_scale(), 96 * size_scale(), long_rows=True), torch.float32))
def test_forward_fp32(student, reference, case):
    check_forward(student, reference, case)


@examples(PROBLEM)
@given(case=norm_cases(shapes(64 * size_scale(), 96 * size_scale()), torch.float16))
def test_forward_fp16(student, reference, case):
    """float16 x: x^2 overflows float16 beyond 256 and is subnormal below 1e-4, so the statistics need float32."""
    check_forward(student, reference, case)


@bf16_gpu_only
@examples(PROBLEM)
@given(case=norm_cases(shapes(64 * size_scale(), 96 * size_scale()), torch.bfloat16))
def test_forward_bf16(student, reference, case):
    check_forward(student, reference, case)


@examples(PROBLEM)
@example(case=EMPTY_CASE)
# Rows of a wider tensor, and an upstream gradient that is not contiguous ("grad_y may have any strides").
@example(case=NormCase((5, 24), torch.float32, "row_padded", "contiguous", "normal", DEFAULT_EPS, 1, "transposed"))
@example(case=LONG_ROW_CASE)
@given(case=norm_cases(shapes(256 * size_scale(), 64 * size_scale(), long_rows=True), torch.float32))
def test_backward_fp32(student, reference, case):
    """grad_x and grad_weight; up to hundreds of rows, so that grad_weight sums the partials of several programs."""
    check_backward(student, reference, case)


@examples(PROBLEM)
@given(case=norm_cases(shapes(256 * size_scale(), 64 * size_scale()), torch.float16))
def test_backward_fp16(student, reference, case):
    check_backward(student, reference, case)


def _ones(*shape, dtype=torch.float32):
    return lambda device: torch.ones(shape, dtype=dtype, device=device)


INVALID = [
    pytest.param(_ones(3, 4, dtype=torch.int32), _ones(4, dtype=torch.int32), 1e-6, "TypeError", id="int32"),
    pytest.param(_ones(3, 4, dtype=torch.float64), _ones(4, dtype=torch.float64), 1e-6, "TypeError", id="float64"),
    pytest.param(_ones(3, 4), _ones(4, dtype=torch.float16), 1e-6, "TypeError", id="weight-dtype-differs"),
    pytest.param(_ones(3, 4), lambda device: [1.0] * 4, 1e-6, "TypeError", id="weight-not-a-tensor"),
    pytest.param(_ones(3, 4), _ones(4), "1e-6", "TypeError", id="eps-a-string"),
    pytest.param(_ones(3, 4), _ones(4), 0.0, "ValueError", id="eps-zero"),
    pytest.param(_ones(3, 4), _ones(4), -1e-6, "ValueError", id="eps-negative"),
    pytest.param(lambda device: torch.tensor(1.0, device=device), _ones(1), 1e-6, "ValueError", id="zero-dim"),
    pytest.param(_ones(3, 0), _ones(0), 1e-6, "ValueError", id="empty-last-dim"),
    pytest.param(_ones(3, 4), _ones(5), 1e-6, "ValueError", id="weight-too-long"),
    pytest.param(_ones(3, 4), _ones(1, 4), 1e-6, "ValueError", id="weight-2d"),
]


@pytest.mark.parametrize("make_x, make_weight, eps, expected_error", INVALID)
def test_invalid_arguments(student, make_x, make_weight, eps, expected_error):
    device = current().device
    x, weight = make_x(device), make_weight(device)
    weight_text = f"weight of shape {tuple(weight.shape)} and {weight.dtype}" if isinstance(weight, torch.Tensor) \
        else f"weight a {type(weight).__name__}"
    assert_raises(student.raises("rmsnorm", x, weight, eps), expected_error,
                  f"rmsnorm(x, weight, eps) for x of shape {tuple(x.shape)} and {x.dtype}, {weight_text}, eps={eps!r}")


@gpu_only
@pytest.mark.parametrize("case", PROBLEM.speed.cases(), ids=str)
def test_speed(student, reference, partial_credit, case):
    grade_speed(SPEEDS[PROBLEM.id], student, reference, case, PROBLEM.speed, partial_credit)
