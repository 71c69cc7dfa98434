"""Grading moe.sigmoid_router: sigmoid affinities, a selection-only bias, renormalised and scaled gates.

Integer outputs (chosen experts, counts) must equal the fast reference's. Gates and gradients are measured against
the plain reference in float64, allowing a multiple of the fast reference's own error plus a floor set by how
exactly any float32 computation can get them. Tokens whose top-(k+1) selection scores are nearly tied are dropped
from the random inputs; exact ties are graded separately, on integer logits and integer biases.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_raises, inputs_if_small
from grader.checks.profiles import examples
from grader.checks.strategies import LAYOUTS, dims, size_scale
from grader.moe.routing_checks import RoutingCase, SigmoidGating, clearly_ordered, low_precision_dtypes
from grader.session.context import current

PROBLEM = BY_ID["moe.sigmoid_router"]
FIELDS = ("expert_index_TK", "gate_TK", "tokens_per_expert_E")
# Standard deviations of the logits: affinities near 1/2 up to nearly saturated ones.
LOGIT_SCALES = (0.25, 1.0, 4.0, 12.0)
# Standard deviations of the bias: none, a nudge, one that often overrides the affinities.
BIAS_STDS = (0.0, 0.02, 0.3)
ROUTE_SCALES = (1.0, 2.5, 0.125)


@dataclass(frozen=True)
class SigmoidCase(RoutingCase):
    """One routing problem, built deterministically from its fields: its description is a recipe to reproduce it.

    values: "normal" draws Gaussian x and weight (logits of standard deviation logit_scale) and a Gaussian bias of
    standard deviation bias_std, and keeps the first `tokens` of twice as many drawn tokens whose selection
    scores are not nearly tied; "integers" draws x in [-2, 2], weight in [-1, 1] (D <= 4, so logits in [-8, 8]) and
    a bias in {-1, 0, 1} (zero when bias_std is 0): equal selection scores are exactly equal, different ones far
    apart; "saturated" is "integers" with the weight times 1000, so every affinity is exactly 0, 1/2 or 1 and many
    selection scores are exactly 0.
    """

    tokens: int
    width: int
    experts: int
    k: int
    route_scale: float
    bias_std: float
    values: str = "normal"
    x_dtype: torch.dtype = torch.float32
    weight_dtype: torch.dtype = torch.float32
    x_layout: str = "contiguous"
    weight_layout: str = "contiguous"
    logit_scale: float = 1.0
    seed: int = 0

    def exact_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x_TD, router_weight_ED and expert_bias_E in float64, holding exactly the values the student receives."""
        generator = torch.Generator().manual_seed(self.seed)
        if self.values == "normal":
            x_TD, weight_ED = self.normal_draw(generator)
            bias_E = torch.randn(self.experts, generator=generator, dtype=torch.float64) * self.bias_std
        else:
            x_TD, weight_ED = self.integer_draw(generator)
            weight_ED = weight_ED * (1000 if self.values == "saturated" else 1)
            bias_E = torch.randint(-1, 2, (self.experts,), generator=generator).double() * (self.bias_std > 0)
        x_TD, weight_ED = self.as_received(x_TD, weight_ED)
        bias_E = bias_E.float().double()
        if self.values == "normal":
            logits_TE = x_TD @ weight_ED.T
            uncertainty_T = (x_TD.abs() @ weight_ED.abs().T).amax(dim=-1) + 2 + bias_E.abs().max()
            x_TD = x_TD[clearly_ordered(torch.sigmoid(logits_TE) + bias_E, self.k, uncertainty_T)][: self.tokens]
        return x_TD, weight_ED, bias_E

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three tensors in the case's dtypes, layouts and device; an example with no token is dropped."""
        x_TD, weight_ED, bias_E = self.exact_inputs()
        return (*self.laid_out_inputs(x_TD, weight_ED), bias_E.float().to(current().device))

    def route_scale_described(self) -> str:
        return "route_scale left at its default" if self.route_scale == 1.0 else f"route_scale={self.route_scale:g}"

    def describe(self, x_TD: torch.Tensor) -> str:
        values = self.values
        if values == "normal":
            values = self.normal_described(f" and bias std {self.bias_std:g}")
        elif self.bias_std == 0:
            values = f"{values}, zero bias"
        return (
            f"T={x_TD.shape[0]}, D={self.width}, E={self.experts}, k={self.k}, {self.route_scale_described()}, "
            f"values={values}, {self.layouts_described()}, expert_bias_E float32, seed={self.seed}"
        ) + inputs_if_small(x_TD=x_TD)


@st.composite
def sigmoid_cases(
    draw,
    dtypes: st.SearchStrategy[tuple[torch.dtype, torch.dtype]] = st.just((torch.float32, torch.float32)),
    values: str = "normal",
) -> SigmoidCase:
    experts = draw(dims(32 * min(size_scale(), 4), tiles=(8, 16, 32, 64, 128)))
    x_dtype, weight_dtype = draw(dtypes)
    return SigmoidCase(
        tokens=draw(dims(64 * size_scale())),
        width=draw(dims(48 * size_scale())) if values == "normal" else draw(dims(4)),
        experts=experts,
        k=draw(st.integers(1, experts)),
        route_scale=draw(st.sampled_from(ROUTE_SCALES)),
        bias_std=draw(st.sampled_from(BIAS_STDS)),
        values=values,
        x_dtype=x_dtype,
        weight_dtype=weight_dtype,
        x_layout=draw(st.sampled_from(LAYOUTS)),
        weight_layout=draw(st.sampled_from(LAYOUTS)),
        logit_scale=draw(st.sampled_from(LOGIT_SCALES)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


class Routing(SigmoidGating):
    """sigmoid_route on one case."""

    problem, function, fields = PROBLEM, "sigmoid_route", FIELDS

    def options(self) -> tuple:
        # route_scale 1.0 is left out of the call: the contract's default is then what is graded.
        return (self.case.k,) if self.case.route_scale == 1.0 else (self.case.k, self.case.route_scale)

    def exact_args(self) -> tuple:
        """The plain reference is always given route_scale."""
        return (*(t.double() for t in self.tensors), self.case.k, self.case.route_scale)


@examples(PROBLEM)
@given(case=sigmoid_cases())
def test_indices_and_gates(student, reference, case):
    routing = Routing(student, reference, case)
    routing.check_equal("expert_index_TK")
    routing.check_gates()


@examples(PROBLEM)
# Selection scores of exactly 0 beside positive and negative ones, in every profile.
@example(case=SigmoidCase(tokens=16, width=4, experts=6, k=2, route_scale=1.0, bias_std=0.02, values="saturated"))
@given(case=st.sampled_from(("integers", "saturated")).flatmap(lambda values: sigmoid_cases(values=values)))
def test_tie_breaking(student, reference, case):
    """Exactly equal selection scores: the lower expert index ranks first."""
    routing = Routing(student, reference, case)
    routing.check_equal("expert_index_TK")
    routing.check_equal("tokens_per_expert_E")


@examples(PROBLEM, 0.5)
@given(case=sigmoid_cases())
def test_tokens_per_expert(student, reference, case):
    Routing(student, reference, case).check_equal("tokens_per_expert_E")


@examples(PROBLEM)
@given(case=sigmoid_cases())
def test_gradients(student, reference, case):
    Routing(student, reference, case).check_gradients()


@examples(PROBLEM, 0.5)
@given(case=sigmoid_cases(dtypes=low_precision_dtypes))
def test_low_precision_inputs(student, reference, case):
    """bfloat16 and float16 inputs: the gates are float32, computed from inputs cast to float32, and the gradients
    arrive in each input's dtype."""
    routing = Routing(student, reference, case)
    routing.check_gates()
    routing.check_equal("expert_index_TK")
    routing.check_gradients()


def _tensors(x_shape=(3, 4), weight_shape=(5, 4), bias_shape=(5,), x_dtype=torch.float32,
             bias_dtype=torch.float32):
    return (x_shape, x_dtype, weight_shape, bias_shape, bias_dtype)


INVALID = [
    pytest.param(_tensors(), 0, 1.0, "ValueError", id="k=0"),
    pytest.param(_tensors(), 6, 1.0, "ValueError", id="k>E"),
    pytest.param(_tensors(weight_shape=(5, 3)), 2, 1.0, "ValueError", id="D-mismatch"),
    pytest.param(_tensors(x_shape=(4,)), 2, 1.0, "ValueError", id="1-D-x"),
    pytest.param(_tensors(x_shape=(0, 4)), 2, 1.0, "ValueError", id="T=0"),
    pytest.param(_tensors(bias_shape=(4,)), 2, 1.0, "ValueError", id="bias-of-wrong-length"),
    pytest.param(_tensors(), 2, 0.0, "ValueError", id="route_scale=0"),
    pytest.param(_tensors(), 2, float("inf"), "ValueError", id="route_scale=inf"),
    pytest.param(_tensors(x_dtype=torch.int64), 2, 1.0, "TypeError", id="int64-x"),
    pytest.param(_tensors(bias_dtype=torch.int32), 2, 1.0, "TypeError", id="int32-bias"),
]


@pytest.mark.parametrize("tensors, k, route_scale, expected_error", INVALID)
def test_invalid_arguments(student, tensors, k, route_scale, expected_error):
    x_shape, x_dtype, weight_shape, bias_shape, bias_dtype = tensors
    device = current().device
    x_TD = torch.ones(x_shape, dtype=x_dtype, device=device)
    weight_ED = torch.ones(weight_shape, device=device)
    bias_E = torch.zeros(bias_shape, dtype=bias_dtype, device=device)
    assert_raises(
        student.raises("sigmoid_route", x_TD, weight_ED, bias_E, k, route_scale), expected_error,
        f"sigmoid_route(x_TD, router_weight_ED, expert_bias_E, k={k}, route_scale={route_scale}) for x_TD of shape "
        f"{x_shape} and {x_dtype}, router_weight_ED of shape {weight_shape}, expert_bias_E of shape {bias_shape} "
        f"and {bias_dtype}",
    )
