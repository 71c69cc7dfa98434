"""Grading moe.sequence_balance_loss: DeepSeek-V3's sequence-wise balance loss, in plain PyTorch.

The loss and its gradient are measured against the plain reference in float64, allowing a multiple of the fast
reference's own float32 error plus a floor scaled by how many float32 terms any computation of them sums (see
loss_floor_scale and gradient_floor_scale). The expert choices are inputs, so nothing here depends on ties.
Evenly spread routing has a known value, alpha, whatever the affinities: that test needs no reference at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_close, assert_raises, check_tensor_form
from grader.checks.outcomes import WrongAnswer
from grader.checks.profiles import examples
from grader.checks.strategies import dims, size_scale
from grader.moe.routing_checks import LOW_PRECISION, dtype_name
from grader.session.context import current

PROBLEM = BY_ID["moe.sequence_balance_loss"]
ALPHAS = (1e-4, 0.01, 1.0)
# Standard deviations of the affinity logits: affinities near 1/2 up to saturated near 0 and 1.
LOGIT_SCALES = (0.5, 2.0, 8.0)
# biased_topk: each token's k largest affinities plus a per-expert selection bias (DeepSeek-V3's routing);
# collapsed: every token of a sequence on the same k experts; even: every expert gets T k / E slots per sequence.
ROUTINGS = ("biased_topk", "collapsed")
LAYOUTS = ("contiguous", "transposed", "sliced")


@dataclass(frozen=True)
class SequenceCase:
    """One batch of affinity logits and expert choices, built deterministically from its fields."""

    batch: int
    tokens: int
    experts: int
    k: int
    alpha: float
    routing: str = "biased_topk"
    logit_scale: float = 1.0
    dtype: torch.dtype = torch.float32
    layout: str = "contiguous"
    seed: int = 0

    @property
    def sequence_length(self) -> int:
        """T; even routing rounds it up to a multiple of E / gcd(E, k), so that T k / E is an integer."""
        if self.routing != "even":
            return self.tokens
        step = self.experts // math.gcd(self.experts, self.k)
        return -(-self.tokens // step) * step

    def exact_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits in float64 holding exactly the values the student receives, expert_index_BTK) on the CPU."""
        generator = torch.Generator().manual_seed(self.seed)
        batch, tokens, experts, k = self.batch, self.sequence_length, self.experts, self.k
        logits_BTE = torch.randn(batch, tokens, experts, generator=generator, dtype=torch.float64) * self.logit_scale
        logits_BTE = logits_BTE.to(self.dtype).double()
        if self.routing == "biased_topk":
            bias_E = torch.randn(experts, generator=generator, dtype=torch.float64) * 0.5
            expert_index_BTK = (torch.sigmoid(logits_BTE) + bias_E).topk(k, dim=-1).indices
        elif self.routing == "collapsed":
            chosen_BK = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(batch)])
            expert_index_BTK = chosen_BK[:, None, :].expand(batch, tokens, k).contiguous()
        else:
            slot_TK = torch.arange(tokens)[:, None] * k + torch.arange(k)
            orders = [torch.randperm(tokens, generator=generator) for _ in range(batch)]
            expert_index_BTK = torch.stack([(slot_TK % experts)[order] for order in orders])
        return logits_BTE, expert_index_BTK

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        logits_BTE, expert_index_BTK = self.exact_inputs()
        logits_BTE = logits_BTE.to(self.dtype)
        if self.layout == "transposed":
            logits_BTE = logits_BTE.transpose(1, 2).contiguous().transpose(1, 2)
        elif self.layout == "sliced":
            wide = logits_BTE.new_zeros(*logits_BTE.shape[:2], 2 * self.experts)
            wide[..., ::2] = logits_BTE
            logits_BTE = wide[..., ::2]
        device = current().device
        return logits_BTE.to(device), expert_index_BTK.to(device)

    def describe(self) -> str:
        return (
            f"B={self.batch}, T={self.sequence_length}, E={self.experts}, k={self.k}, alpha={self.alpha:g}, "
            f"routing={self.routing}, logit scale {self.logit_scale:g}, affinity_logits_BTE "
            f"{dtype_name(self.dtype)} {self.layout}, seed={self.seed}"
        )


@st.composite
def sequence_cases(draw, routings=ROUTINGS, dtypes=(torch.float32,)) -> SequenceCase:
    experts = draw(dims(32 * size_scale(), tiles=(8, 16, 32, 64)))
    return SequenceCase(
        batch=draw(dims(4 * size_scale(), tiles=())),
        tokens=draw(dims(32 * size_scale())),
        experts=experts,
        k=draw(st.integers(1, min(experts, 8))),
        alpha=draw(st.sampled_from(ALPHAS)),
        routing=draw(st.sampled_from(routings)),
        logit_scale=draw(st.sampled_from(LOGIT_SCALES)),
        dtype=draw(st.sampled_from(dtypes)),
        layout=draw(st.sampled_from(LAYOUTS)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def loss_floor_scale(case: SequenceCase, exact: torch.Tensor) -> float:
    """The loss is a sum of positive terms: sums of T normalised affinities, of E products, of B sequences. Each way
    of ordering those float32 sums is exact to about sqrt(terms) ulps of the result (rounding errors of random sign)."""
    return float(exact.abs()) * math.sqrt(case.sequence_length + case.experts + case.batch)


def gradient_floor_scale(case: SequenceCase, logits_BTE: torch.Tensor, expert_index_BTK: torch.Tensor,
                         upstream: float) -> float:
    """dL/dl_(t,j) = alpha / (B T) * (f_j - sum_i f_i s'_(t,i)) * s_j (1 - s_j) / sum_i s_i: a difference of
    terms up to max f whose float32 error does not shrink where they cancel (even routing has a zero gradient)."""
    batch, tokens, experts = logits_BTE.shape
    affinity_BTE = torch.sigmoid(logits_BTE.double().cpu())
    slope_BTE = affinity_BTE * (1 - affinity_BTE) / affinity_BTE.sum(dim=-1, keepdim=True)
    counts_BE = torch.zeros(batch, experts, dtype=torch.float64)
    counts_BE.scatter_add_(1, expert_index_BTK.cpu().reshape(batch, -1),
                           torch.ones(batch, expert_index_BTK[0].numel(), dtype=torch.float64))
    max_load = float(counts_BE.max()) * experts / (case.k * tokens)
    return abs(upstream) * case.alpha / (batch * tokens) * max_load * float(slope_BTE.max()) * math.sqrt(experts)


def compare_floating(actual, exact, expected_at_dtype, floor_scale: float, what: str, context: str) -> None:
    """assert_close with the error floor PROBLEM.floor_ulps ulps of floor_scale (or of the result, if larger).

    A result far below that floor (the gradient of evenly spread routing is exactly zero) is compared with the same
    bound directly: assert_close measures its floor relative to the result."""
    check_tensor_form(actual, expected_at_dtype, what, context)
    exact64 = exact.double().cpu()
    result_scale = float(exact64.abs().max())
    floor_scale = max(floor_scale, result_scale)
    eps = torch.finfo(actual.dtype).eps
    if result_scale > PROBLEM.floor_ulps * eps * floor_scale:
        assert_close(actual, exact, expected_at_dtype, what=what, context=context, multiple=PROBLEM.error_multiple,
                     floor_ulps=PROBLEM.floor_ulps * floor_scale / result_scale)
        return
    reference_error = float((expected_at_dtype.double().cpu() - exact64).abs().max())
    allowed = PROBLEM.error_multiple * reference_error + PROBLEM.floor_ulps * eps * floor_scale
    error = float((actual.double().cpu() - exact64).abs().max())
    if not error <= allowed:  # NaN fails too
        raise WrongAnswer(
            f"{what}: out of tolerance; largest error {error:.3g}, allowed {allowed:.3g} = {PROBLEM.error_multiple:g}"
            f" x reference error {reference_error:.3g} + {PROBLEM.floor_ulps:g} ulp x scale {floor_scale:.3g}"
            f" ({context})"
        )


class Balance:
    """The student's loss on one case, the fast reference's at the case's dtype and the plain one's in float64."""

    def __init__(self, student, reference, case: SequenceCase):
        self.student, self.reference, self.case = student, reference, case
        self.logits_BTE, self.expert_index_BTK = case.inputs()
        self.context = case.describe()
        with student.describing(self.context):
            self.actual = student.call("sequence_balance_loss", self.logits_BTE, self.expert_index_BTK, case.alpha)
        with torch.no_grad():
            self.at_dtype = reference.sequence_balance_loss(self.logits_BTE, self.expert_index_BTK, case.alpha)
            self.exact = reference.sequence_balance_loss_torch(self.logits_BTE.double(), self.expert_index_BTK,
                                                               case.alpha)

    def check_loss(self, exact: torch.Tensor | None = None) -> None:
        exact = self.exact if exact is None else exact
        compare_floating(self.actual, exact, self.at_dtype, loss_floor_scale(self.case, exact), "loss",
                         self.context)

    def check_gradient(self) -> None:
        generator = torch.Generator().manual_seed(self.case.seed + 1)
        upstream = torch.randn((), generator=generator).to(current().device)
        grad = {"inputs": [0], "upstream": [upstream]}
        arguments = (self.logits_BTE, self.expert_index_BTK, self.case.alpha)
        with self.student.describing(self.context):
            actual = self.student.call_traced("sequence_balance_loss", *arguments, grad=grad)["grads"][0]
        what = "gradient of affinity_logits_BTE"
        if actual is None:
            raise WrongAnswer(f"{what}: affinity_logits_BTE received no gradient ({self.context})")
        exact = self.reference_gradient(self.reference.sequence_balance_loss_torch, self.logits_BTE.double(), upstream)
        at_dtype = self.reference_gradient(self.reference.sequence_balance_loss, self.logits_BTE, upstream)
        floor_scale = gradient_floor_scale(self.case, self.logits_BTE, self.expert_index_BTK, float(upstream))
        compare_floating(actual, exact, at_dtype, floor_scale, what, self.context)

    def reference_gradient(self, loss_function, logits_BTE: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor:
        logits_BTE = logits_BTE.detach().requires_grad_(True)
        loss = loss_function(logits_BTE, self.expert_index_BTK, self.case.alpha)
        loss.backward(upstream.to(loss.dtype))
        return logits_BTE.grad


@examples(PROBLEM)
@given(case=sequence_cases())
def test_loss(student, reference, case):
    Balance(student, reference, case).check_loss()


@examples(PROBLEM, 0.5)
@given(case=sequence_cases(routings=("even",)))
def test_even_routing(student, reference, case):
    """Every f_i is 1 and the normalised affinities sum to 1, so the loss is alpha whatever the affinities."""
    Balance(student, reference, case).check_loss(exact=torch.tensor(case.alpha, dtype=torch.float64))


@examples(PROBLEM)
@given(case=sequence_cases(routings=(*ROUTINGS, "even")))
def test_gradients(student, reference, case):
    Balance(student, reference, case).check_gradient()


@examples(PROBLEM, 0.5)
@given(case=sequence_cases(dtypes=LOW_PRECISION))
def test_low_precision_inputs(student, reference, case):
    """bfloat16 and float16 logits: the loss is float32, computed from the logits cast to float32, and the gradient
    arrives in the logits' dtype."""
    balance = Balance(student, reference, case)
    balance.check_loss()
    balance.check_gradient()


def invalid(logits_shape, index_rows, error="ValueError", logits_dtype=torch.float32, index_dtype=torch.int64,
            alpha=0.1, id=None):
    return pytest.param(logits_shape, logits_dtype, index_rows, index_dtype, alpha, error, id=id)


INVALID = [
    invalid((1, 2, 3), [[[0], [1]]], alpha=-0.5, id="alpha<0"),
    invalid((1, 2, 3), [[[0], [3]]], id="index>=E"),
    invalid((1, 2, 3), [[[0], [-1]]], id="index<0"),
    invalid((1, 2, 3), [[[0, 1, 2, 0], [1, 2, 0, 1]]], id="k>E"),
    invalid((1, 2, 3), [[[], []]], id="k=0"),
    invalid((1, 2, 3), [[[0], [1], [2]]], id="T-mismatch"),
    invalid((2, 2, 3), [[[0], [1]]], id="B-mismatch"),
    invalid((0, 2, 3), [], id="B=0"),
    invalid((2, 3), [[0], [1]], id="2-D"),
    # Only the indices 2-D, shaped like the logits' [B, T]: no later shape check sees it.
    invalid((1, 2, 3), [[0, 1]], id="2-D-indices"),
    invalid((1, 2, 3), [[[0], [1]]], logits_dtype=torch.int64, error="TypeError", id="int64-logits"),
    invalid((1, 2, 3), [[[0], [1]]], index_dtype=torch.int32, error="TypeError", id="int32-indices"),
]


@pytest.mark.parametrize("logits_shape, logits_dtype, index_rows, index_dtype, alpha, expected_error", INVALID)
def test_invalid_arguments(student, logits_shape, logits_dtype, index_rows, index_dtype, alpha, expected_error):
    device = current().device
    logits_BTE = torch.zeros(logits_shape, dtype=logits_dtype, device=device)
    expert_index_BTK = torch.tensor(index_rows, dtype=index_dtype, device=device)
    if not index_rows:
        expert_index_BTK = expert_index_BTK.reshape(0, logits_shape[1], 1)
    assert_raises(
        student.raises("sequence_balance_loss", logits_BTE, expert_index_BTK, alpha), expected_error,
        f"sequence_balance_loss(affinity_logits_BTE of shape {logits_shape} and {logits_dtype}, "
        f"expert_index_BTK={index_rows} ({index_dtype}), alpha={alpha})",
    )
