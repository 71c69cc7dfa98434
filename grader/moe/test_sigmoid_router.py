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
from hypothesis import assume, example, given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_equal, assert_raises, inputs_if_small
from grader.checks.profiles import examples
from grader.checks.strategies import LAYOUTS, dims, size_scale
from grader.moe.routing_checks import (
    clearly_ordered,
    compare_floating,
    compare_gradients,
    dtype_name,
    laid_out,
    reference_gradients,
    returned_fields,
    router_term_scales,
)
from grader.session.context import current

PROBLEM = BY_ID["moe.sigmoid_router"]
FIELDS = ("expert_index_TK", "gate_TK", "tokens_per_expert_E")
# Standard deviations of the logits: affinities near 1/2 up to nearly saturated ones.
LOGIT_SCALES = (0.25, 1.0, 4.0, 12.0)
# Standard deviations of the bias: none, a nudge, one that often overrides the affinities.
BIAS_STDS = (0.0, 0.02, 0.3)
ROUTE_SCALES = (1.0, 2.5, 0.125)
LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SigmoidCase:
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
            x_TD = torch.randn(2 * self.tokens, self.width, generator=generator, dtype=torch.float64)
            weight_ED = torch.randn(self.experts, self.width, generator=generator, dtype=torch.float64)
            weight_ED = weight_ED * (self.logit_scale / self.width**0.5)
            bias_E = torch.randn(self.experts, generator=generator, dtype=torch.float64) * self.bias_std
        else:
            x_TD = torch.randint(-2, 3, (self.tokens, self.width), generator=generator).double()
            weight_ED = torch.randint(-1, 2, (self.experts, self.width), generator=generator).double()
            weight_ED = weight_ED * (1000 if self.values == "saturated" else 1)
            bias_E = torch.randint(-1, 2, (self.experts,), generator=generator).double() * (self.bias_std > 0)
        x_TD = x_TD.to(self.x_dtype).double()
        weight_ED = weight_ED.to(self.weight_dtype).double()
        bias_E = bias_E.float().double()
        if self.values == "normal":
            logits_TE = x_TD @ weight_ED.T
            uncertainty_T = (x_TD.abs() @ weight_ED.abs().T).amax(dim=-1) + 2 + bias_E.abs().max()
            x_TD = x_TD[clearly_ordered(torch.sigmoid(logits_TE) + bias_E, self.k, uncertainty_T)][: self.tokens]
        return x_TD, weight_ED, bias_E

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three tensors in the case's dtypes, layouts and device; an example with no token is dropped."""
        x_TD, weight_ED, bias_E = self.exact_inputs()
        assume(x_TD.shape[0] > 0)
        device = current().device
        return (
            laid_out(x_TD.to(self.x_dtype), self.x_layout).to(device),
            laid_out(weight_ED.to(self.weight_dtype), self.weight_layout).to(device),
            bias_E.float().to(device),
        )

    def route_scale_described(self) -> str:
        return "route_scale left at its default" if self.route_scale == 1.0 else f"route_scale={self.route_scale:g}"

    def describe(self, x_TD: torch.Tensor) -> str:
        values = self.values
        if values == "normal":
            values = (f"normal with logit scale {self.logit_scale:g} and bias std {self.bias_std:g}, of "
                      f"{2 * self.tokens} tokens those not nearly tied")
        elif self.bias_std == 0:
            values = f"{values}, zero bias"
        return (
            f"T={x_TD.shape[0]}, D={self.width}, E={self.experts}, k={self.k}, {self.route_scale_described()}, "
            f"values={values}, x_TD {dtype_name(self.x_dtype)} {self.x_layout}, "
            f"router_weight_ED {dtype_name(self.weight_dtype)} {self.weight_layout}, expert_bias_E float32, "
            f"seed={self.seed}"
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


class Routing:
    """The student's routing of one case, the fast reference's at the case's dtypes (whose integer outputs must be
    matched exactly and whose float32 error calibrates the tolerances) and the plain reference's in float64.

    Floors: a float32 logit is exact only to a few ulps of max_e sum_d |x_d w_ed| =: U_t, so an affinity is
    relatively uncertain by about U_t + 1 ulps, and so is every gate, whatever the algorithm.
    """

    def __init__(self, student, reference, case: SigmoidCase):
        self.student, self.reference, self.case = student, reference, case
        self.x_TD, self.weight_ED, self.bias_E = case.inputs()
        self.context = case.describe(self.x_TD)
        # route_scale 1.0 is left out of the call: the contract's default is then what is graded.
        scale_argument = () if case.route_scale == 1.0 else (case.route_scale,)
        self.args = (self.x_TD, self.weight_ED, self.bias_E, case.k, *scale_argument)
        with student.describing(self.context):
            value = student.call("sigmoid_route", *self.args)
        self.actual = returned_fields(value, FIELDS, "sigmoid_route", self.context)
        with torch.no_grad():
            self.at_dtype = dict(zip(FIELDS, reference.sigmoid_route(*self.args)))
            self.exact = dict(zip(FIELDS, reference.sigmoid_route_torch(*self.exact_args())))
        x64, weight64 = self.x_TD.double().cpu(), self.weight_ED.double().cpu()
        self.uncertainty_T = 1 + (x64.abs() @ weight64.abs().T).amax(dim=-1)

    def exact_args(self) -> tuple:
        return (self.x_TD.double(), self.weight_ED.double(), self.bias_E.double(), self.case.k, self.case.route_scale)

    def check_equal(self, name: str) -> None:
        assert_equal(self.actual[name], self.at_dtype[name], what=name, context=self.context)

    def check_gates(self) -> None:
        floor_scale = self.case.route_scale * float(self.uncertainty_T.max())
        compare_floating(self.actual["gate_TK"], self.exact["gate_TK"], self.at_dtype["gate_TK"], floor_scale,
                         PROBLEM, "gate_TK", self.context)

    def check_gradients(self) -> None:
        generator = torch.Generator().manual_seed(self.case.seed + 1)
        upstream = torch.randn(self.exact["gate_TK"].shape, generator=generator, dtype=torch.float64).float()
        upstream = upstream.to(current().device)
        grad = {"inputs": [0, 1], "upstream": [None, upstream, None]}
        with self.student.describing(self.context):
            actual = self.student.call_traced("sigmoid_route", *self.args, grad=grad)["grads"]
        gate_field = FIELDS.index("gate_TK")
        exact = reference_gradients(self.reference.sigmoid_route_torch, self.exact_args(), (0, 1), gate_field, upstream)
        at_dtype = reference_gradients(self.reference.sigmoid_route, self.args, (0, 1), gate_field, upstream)
        # Per token, the backward pass sums terms of about route_scale * |upstream| into each logit, each
        # uncertain by U_t ulps, then multiplies them by the other operand of the logit's product.
        per_token_T = self.case.route_scale * upstream.double().cpu().abs().sum(dim=-1) * self.uncertainty_T
        term_scales = router_term_scales(per_token_T, self.x_TD, self.weight_ED)
        compare_gradients(actual, exact, at_dtype, ("x_TD", "router_weight_ED"), term_scales, PROBLEM, " from gate_TK",
                          self.context)


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


low_precision_dtypes = st.tuples(
    st.sampled_from(LOW_PRECISION), st.sampled_from((*LOW_PRECISION, torch.float32))
).flatmap(lambda pair: st.sampled_from((pair, pair[::-1])))


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
