"""Grading moe.noisy_topk: noisy top-k gating with the noise injected by the grader, noise-free in evaluation.

Chosen experts must equal the fast reference's. Gates, noisy logits and gradients are measured against the plain
reference in float64, allowing a multiple of the fast reference's own error plus a floor set by how exactly any
float32 computation can get them. Tokens whose top-(k+1) noisy logits are nearly tied are dropped from the random
inputs; exact ties are graded separately, on integer logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_raises, inputs_if_small
from grader.checks.profiles import examples
from grader.checks.strategies import LAYOUTS, dims, size_scale
from grader.moe.routing_checks import RoutingCase, RoutingCheck, clearly_ordered, dtype_name
from grader.session.context import current

PROBLEM = BY_ID["moe.noisy_topk"]
FIELDS = ("expert_index_TK", "gate_TK", "noisy_logits_TE")
WEIGHTS = ("x_TD", "gate_weight_ED", "noise_weight_ED")
# Standard deviations of the clean logits, and of the noise weights' products (softplus of about N(0, s^2) sets
# the noise's size): routing from nearly uniform to nearly decided, noise from small to dominant.
LOGIT_SCALES = (0.25, 1.0, 4.0)
NOISE_SCALES = (0.5, 2.0, 8.0)
DTYPES = (torch.float32, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class NoisyCase(RoutingCase):
    """One routing problem, built deterministically from its fields: its description is a recipe to reproduce it.

    values: "normal" draws Gaussian x, weights and noise, and keeps the first `tokens` of twice as many drawn tokens
    whose top-(k+1) logits (noisy in training, clean in evaluation) are not nearly tied; "integers" draws x in
    [-2, 2] and gate weights in [-1, 1] (D <= 8), so equal logits are exactly equal, with Gaussian noise weights and
    zero noise in training (noise * softplus is then exactly 0) and Gaussian noise in evaluation.
    """

    tokens: int
    width: int
    experts: int
    k: int
    training: bool
    values: str = "normal"
    x_dtype: torch.dtype = torch.float32
    weight_dtype: torch.dtype = torch.float32
    x_layout: str = "contiguous"
    weight_layout: str = "contiguous"
    logit_scale: float = 1.0
    noise_scale: float = 1.0
    seed: int = 0

    def exact_inputs(self) -> tuple[torch.Tensor, ...]:
        """x_TD, gate_weight_ED, noise_weight_ED and noise_TE in float64, holding exactly the student's values."""
        generator = torch.Generator().manual_seed(self.seed)
        x_TD, gate_ED = self.normal_draw(generator) if self.values == "normal" else self.integer_draw(generator)
        noise_weight_ED = torch.randn(self.experts, self.width, generator=generator, dtype=torch.float64) * (
            self.noise_scale / self.width**0.5)
        noise_TE = torch.randn(x_TD.shape[0], self.experts, generator=generator, dtype=torch.float64).float().double()
        if self.values == "integers" and self.training:
            noise_TE.zero_()
        x_TD, gate_ED, noise_weight_ED = self.as_received(x_TD, gate_ED, noise_weight_ED)
        if self.values == "normal":
            logits_TE, uncertainty_T = self.logits_and_uncertainty(x_TD, gate_ED, noise_weight_ED, noise_TE)
            clear_T = clearly_ordered(logits_TE, self.k, uncertainty_T)
            x_TD, noise_TE = x_TD[clear_T][: self.tokens], noise_TE[clear_T][: self.tokens]
        return x_TD, gate_ED, noise_weight_ED, noise_TE

    def logits_and_uncertainty(self, x_TD, gate_ED, noise_weight_ED, noise_TE) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 noisy logits [T, E], and per token the size U_t of the terms summed into them: any float32
        computation gets a logit to within a few ulps of U_t."""
        logits_TE = x_TD @ gate_ED.T
        terms_TE = x_TD.abs() @ gate_ED.abs().T
        if self.training:
            noise_input_TE = x_TD @ noise_weight_ED.T
            logits_TE = logits_TE + noise_TE * torch.nn.functional.softplus(noise_input_TE)
            noise_terms_TE = x_TD.abs() @ noise_weight_ED.abs().T + noise_input_TE.clamp(min=0) + 1
            terms_TE = terms_TE + noise_TE.abs() * noise_terms_TE
        return logits_TE, terms_TE.amax(dim=-1) + 1

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The four tensors in the case's dtypes, layouts and device; an example with no token is dropped."""
        x_TD, gate_ED, noise_weight_ED, noise_TE = self.exact_inputs()
        return (*self.laid_out_inputs(x_TD, gate_ED, noise_weight_ED), noise_TE.float().to(current().device))

    def describe(self, x_TD: torch.Tensor) -> str:
        values = self.values
        if values == "normal":
            values = self.normal_described(f" and noise scale {self.noise_scale:g}")
        elif self.training:
            values = "integers, zero noise"
        return (
            f"T={x_TD.shape[0]}, D={self.width}, E={self.experts}, k={self.k}, training={self.training}, "
            f"values={values}, {self.layouts_described('gate_weight_ED and noise_weight_ED')}, noise_TE float32, "
            f"seed={self.seed}"
        ) + inputs_if_small(x_TD=x_TD)


@st.composite
def noisy_cases(draw, training: st.SearchStrategy[bool] = st.booleans(), values: str = "normal") -> NoisyCase:
    experts = draw(dims(32 * min(size_scale(), 4), tiles=(8, 16, 32, 64, 128)))
    dtypes = (torch.float32,) if values == "integers" else DTYPES
    return NoisyCase(
        tokens=draw(dims(64 * size_scale())),
        width=draw(dims(8)) if values == "integers" else draw(dims(48 * size_scale())),
        experts=experts,
        k=draw(st.integers(1, experts)),
        training=draw(training),
        values=values,
        x_dtype=draw(st.sampled_from(dtypes)),
        weight_dtype=draw(st.sampled_from(dtypes)),
        x_layout=draw(st.sampled_from(LAYOUTS)),
        weight_layout=draw(st.sampled_from(LAYOUTS)),
        logit_scale=draw(st.sampled_from(LOGIT_SCALES)),
        noise_scale=draw(st.sampled_from(NOISE_SCALES)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


class Routing(RoutingCheck):
    """noisy_topk_route on one case; in evaluation, where the noise weight is unused, its gradient is not checked.

    Floors: a float32 noisy logit is exact only to a few ulps of U_t (see NoisyCase.logits_and_uncertainty), and a
    gate, a softmax of such logits, to about U_t ulps of itself, whatever the algorithm.
    """

    problem, function, fields, input_names = PROBLEM, "noisy_topk_route", FIELDS, WEIGHTS
    differentiable = ("gate_TK", "noisy_logits_TE")

    def __init__(self, student, reference, case: NoisyCase):
        super().__init__(student, reference, case)
        self.exact64 = [t.double().cpu() for t in self.tensors]
        self.uncertainty_T = case.logits_and_uncertainty(*self.exact64)[1]

    def options(self) -> tuple:
        return (self.case.k, self.case.training)

    def wrt(self) -> tuple[int, ...]:
        return (0, 1, 2) if self.case.training else (0, 1)

    def check_close(self, name: str) -> None:
        self.check_floating(name, float(self.uncertainty_T.max()))

    def gradient_term_scales(self, field: str, upstream: torch.Tensor) -> tuple[float, float, float]:
        # Per token, the backward pass sums terms of about |upstream| into each logit (times U_t ulps of
        # uncertainty through a softmax), then multiplies them by the other operands of the logit's products.
        x_TD, gate_ED, noise_weight_ED, noise_TE = self.exact64
        per_token_T = upstream.double().cpu().abs().sum(dim=-1)
        if field == "gate_TK":
            per_token_T = per_token_T * self.uncertainty_T
        noise_size = float(noise_TE.abs().max()) if self.case.training else 0.0
        weights_D = gate_ED.abs().amax(dim=0) + noise_size * noise_weight_ED.abs().amax(dim=0)
        weight_scale = float((per_token_T @ x_TD.abs()).max()) * (1 + noise_size)
        return (float((per_token_T[:, None] * weights_D).max()), weight_scale, weight_scale)


@examples(PROBLEM)
@given(case=noisy_cases(training=st.just(True)))
def test_indices_and_gates(student, reference, case):
    routing = Routing(student, reference, case)
    routing.check_equal("expert_index_TK")
    routing.check_close("gate_TK")


@examples(PROBLEM)
@given(case=noisy_cases(training=st.just(False)))
def test_eval_is_noise_free(student, reference, case):
    """In evaluation the grader still passes (large) noise: no output may depend on it."""
    routing = Routing(student, reference, case)
    routing.check_close("noisy_logits_TE")
    routing.check_equal("expert_index_TK")
    routing.check_close("gate_TK")


@examples(PROBLEM, 0.5)
@given(case=noisy_cases())
def test_noisy_logits(student, reference, case):
    Routing(student, reference, case).check_close("noisy_logits_TE")


@examples(PROBLEM, 0.5)
@given(case=noisy_cases(values="integers"))
def test_tie_breaking(student, reference, case):
    """Exactly equal logits: the lower expert index ranks first."""
    Routing(student, reference, case).check_equal("expert_index_TK")


@examples(PROBLEM)
@given(case=noisy_cases())
def test_gradients(student, reference, case):
    Routing(student, reference, case).check_gradients()


def _shapes(x=(3, 4), gate=(5, 4), noise_weight=(5, 4), noise=(3, 5)):
    return (x, gate, noise_weight, noise)


INVALID = [
    pytest.param(_shapes(), 0, None, "ValueError", id="k=0"),
    pytest.param(_shapes(), 6, None, "ValueError", id="k>E"),
    pytest.param(_shapes(gate=(5, 3), noise_weight=(5, 3)), 2, None, "ValueError", id="D-mismatch"),
    pytest.param(_shapes(noise_weight=(4, 4)), 2, None, "ValueError", id="weights-differ"),
    pytest.param(_shapes(noise=(3, 4)), 2, None, "ValueError", id="noise-of-wrong-shape"),
    pytest.param(_shapes(x=(0, 4), noise=(0, 5)), 2, None, "ValueError", id="T=0"),
    pytest.param(_shapes(x=(4,)), 2, None, "ValueError", id="1-D-x"),
    pytest.param(_shapes(), 2, 0, "TypeError", id="int64-x"),
    pytest.param(_shapes(), 2, 3, "TypeError", id="int64-noise"),
]


@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
@pytest.mark.parametrize("shapes, k, integer_argument, expected_error", INVALID)
def test_invalid_arguments(student, shapes, k, integer_argument, expected_error, training):
    device = current().device
    tensors = [torch.ones(shape, device=device) for shape in shapes]
    if integer_argument is not None:
        tensors[integer_argument] = tensors[integer_argument].long()
    described = ", ".join(f"{name} {tuple(t.shape)} {dtype_name(t.dtype)}"
                          for name, t in zip((*WEIGHTS, "noise_TE"), tensors))
    assert_raises(
        student.raises("noisy_topk_route", *tensors, k, training), expected_error,
        f"noisy_topk_route(..., k={k}, training={training}) for {described}",
    )
