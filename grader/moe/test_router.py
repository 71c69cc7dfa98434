"""Grading moe.router: top-k token-choice routing with its load-balancing and z losses, in plain PyTorch.

Integer outputs (chosen experts, counts) must equal the fast reference's at float32. Floating outputs and gradients
are measured against the plain reference in float64, allowing a multiple of the fast reference's own float32 error
plus a floor set by how exactly any float32 computation can get them (see Sensitivity). Tokens whose top-(k+1)
probabilities are nearly tied are dropped from the random inputs: there, two correct float32 computations may
legitimately choose differently. Exact ties are graded separately, on integer logits.
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
from grader.moe.routing_checks import (
    RoutingCase,
    RoutingCheck,
    low_precision_dtypes,
    router_term_scales,
    separated_rows,
)
from grader.session.context import current

PROBLEM = BY_ID["moe.router"]
FIELDS = ("expert_index_TK", "gate_TK", "tokens_per_expert_E", "balance_loss", "z_loss")
# Standard deviations of the logits of Gaussian inputs: nearly uniform routing up to nearly one-hot routing.
LOGIT_SCALES = (0.25, 1.0, 4.0, 16.0)


@dataclass(frozen=True)
class RouterCase(RoutingCase):
    """One routing problem, built deterministically from its fields: its description is a recipe to reproduce it.

    values: "normal" draws Gaussian x and weight, the weight scaled so that the logits' standard deviation is
    logit_scale, and keeps the first `tokens` of twice as many drawn tokens that are not nearly tied; "integers"
    draws x in [-2, 2] and weight in [-1, 1]; "identity" draws x in [0, 2] with the identity as weight (D == E).
    Integer logits are exact in float32, so their ties are exact.
    """

    tokens: int
    width: int
    experts: int
    k: int
    normalize_topk: bool
    values: str = "normal"
    x_dtype: torch.dtype = torch.float32
    weight_dtype: torch.dtype = torch.float32
    x_layout: str = "contiguous"
    weight_layout: str = "contiguous"
    logit_scale: float = 1.0
    seed: int = 0

    def exact_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x_TD and router_weight_ED in float64, holding exactly the values the student receives."""
        generator = torch.Generator().manual_seed(self.seed)
        if self.values == "normal":
            x_TD, weight_ED = self.normal_draw(generator)
        elif self.values == "integers":
            x_TD, weight_ED = self.integer_draw(generator)
        else:
            x_TD = torch.randint(0, 3, (self.tokens, self.width), generator=generator).double()
            weight_ED = torch.eye(self.experts, self.width, dtype=torch.float64)
        x_TD, weight_ED = self.as_received(x_TD, weight_ED)
        if self.values == "normal":
            x_TD = x_TD[separated_rows(x_TD, weight_ED, self.k)][: self.tokens]
        return x_TD, weight_ED

    def describe(self, x_TD: torch.Tensor) -> str:
        values = self.normal_described() if self.values == "normal" else self.values
        return (
            f"T={x_TD.shape[0]}, D={self.width}, E={self.experts}, k={self.k}, normalize_topk={self.normalize_topk}, "
            f"values={values}, {self.layouts_described()}, seed={self.seed}"
        ) + inputs_if_small(x_TD=x_TD)


@st.composite
def router_cases(
    draw,
    dtypes: st.SearchStrategy[tuple[torch.dtype, torch.dtype]] = st.just((torch.float32, torch.float32)),
    values: tuple[str, ...] = ("normal",),
) -> RouterCase:
    kind = draw(st.sampled_from(values))
    experts = draw(dims(32 * min(size_scale(), 4), tiles=(8, 16, 32, 64, 128)))
    if kind == "identity":
        width = experts
    elif kind == "integers":
        width = draw(dims(8))  # logits within [-16, 16]: no probability underflows to a tie at zero
    else:
        width = draw(dims(48 * size_scale()))
    x_dtype, weight_dtype = draw(dtypes)
    return RouterCase(
        tokens=draw(dims(64 * size_scale())),
        width=width,
        experts=experts,
        k=draw(st.integers(1, experts)),
        normalize_topk=draw(st.booleans()),
        values=kind,
        x_dtype=x_dtype,
        weight_dtype=weight_dtype,
        x_layout=draw(st.sampled_from(LAYOUTS)),
        weight_layout=draw(st.sampled_from(LAYOUTS)),
        logit_scale=draw(st.sampled_from(LOGIT_SCALES)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


class Sensitivity:
    """How exactly any float32 computation can get the outputs of one case: the error floors of its comparisons.

    A float32 logit is exact only to a few ulps of its largest terms, max_e sum_d |x_d w_ed|, and a probability
    computed from it (as exp(l - lse), say) only to a few ulps of itself times |l - lse| + |lse|. So every output
    inherits an uncertainty of about U_t = max_e sum_d |x_d w_ed| + |lse_t| ulps of what it is made of, whatever
    the algorithm. The reference's fused softmax often does far better, so its own error alone would fail correct
    computations (a softmax written out, log_softmax then exp); the floors scale with U_t instead.
    """

    def __init__(self, x_TD: torch.Tensor, weight_ED: torch.Tensor, case: RouterCase, exact: dict):
        self.case, self.exact = case, exact
        self.x_TD, self.weight_ED = x_TD.double().cpu(), weight_ED.double().cpu()
        logits_TE = self.x_TD @ self.weight_ED.T
        self.probs_TE = torch.softmax(logits_TE, dim=-1)
        self.lse_T = torch.logsumexp(logits_TE, dim=-1)
        self.uncertainty_T = (self.x_TD.abs() @ self.weight_ED.abs().T).amax(dim=-1) + self.lse_T.abs()

    def floor_scale(self, field: str) -> float:
        """The magnitude whose floor_ulps ulps an output of the case may be off by (see compare_floating)."""
        if field == "z_loss":
            # z_loss = mean_t lse_t^2 is off by about mean_t 2 |lse_t| U_t ulps, far more than |z_loss| ulps where
            # a token's logits nearly cancel.
            return float((2 * self.lse_T.abs() * self.uncertainty_T).mean())
        return float(self.exact[field].abs().max()) * (1 + float(self.uncertainty_T.max()))

    def gradient_term_scales(self, field: str, upstream: torch.Tensor) -> tuple[float, float]:
        """How large the terms are that a backward pass from `field` sums into each input's gradient.

        Per token t, every way of computing the gradient sums terms of about probs_TE[t, e] G_t, where G_t is the
        size of the upstream gradient reaching that token's probabilities, each uncertain by about U_t ulps; and a
        softmax written out with the row maximum subtracted routes all of them through one logit. Where the terms
        cancel (the balance loss of one token whose k experts hold nearly all the probability, say), float32
        cannot resolve the difference, so the floor scales with G_t (1 + U_t) rather than with the result.
        """
        upstream = upstream.double().cpu()
        num_tokens, num_experts = self.x_TD.shape[0], self.weight_ED.shape[0]
        if field == "gate_TK":
            per_token_T = upstream.abs().sum(dim=-1)
            if self.case.normalize_topk:
                chosen_T = self.probs_TE.gather(1, self.exact["expert_index_TK"].cpu()).sum(dim=-1)
                per_token_T = per_token_T / chosen_T
        elif field == "balance_loss":
            slot_fraction_E = self.exact["tokens_per_expert_E"].cpu().double() / (num_tokens * self.case.k)
            per_token_T = (upstream.abs() * num_experts * slot_fraction_E.max() / num_tokens).expand(num_tokens)
        else:
            per_token_T = upstream.abs() * 2 * (self.lse_T.abs() + 1) / num_tokens
        return router_term_scales(per_token_T * (1 + self.uncertainty_T), self.x_TD, self.weight_ED)


class Routing(RoutingCheck):
    """topk_route on one case, its floors set by Sensitivity."""

    problem, function, fields, output = PROBLEM, "topk_route", FIELDS, "a RouterOutput"
    differentiable = ("gate_TK", "balance_loss", "z_loss")

    def __init__(self, student, reference, case: RouterCase):
        super().__init__(student, reference, case)
        self.sensitivity = Sensitivity(self.x_TD, self.weight_ED, case, self.exact)

    def options(self) -> tuple:
        return (self.case.k, self.case.normalize_topk)

    def check_close(self, name: str) -> None:
        self.check_floating(name, self.sensitivity.floor_scale(name))

    def gradient_term_scales(self, field: str, upstream: torch.Tensor) -> tuple[float, float]:
        return self.sensitivity.gradient_term_scales(field, upstream)


@examples(PROBLEM)
@given(case=router_cases())
def test_indices_and_gates(student, reference, case):
    routing = Routing(student, reference, case)
    routing.check_equal("expert_index_TK")
    routing.check_close("gate_TK")


@examples(PROBLEM)
@given(case=router_cases(values=("integers", "identity")))
def test_tie_breaking(student, reference, case):
    """Exactly equal probabilities: the lower expert index ranks first, and the order is by (prob desc, index asc)."""
    Routing(student, reference, case).check_equal("expert_index_TK")


@examples(PROBLEM, 0.5)
@given(case=router_cases())
def test_tokens_per_expert(student, reference, case):
    Routing(student, reference, case).check_equal("tokens_per_expert_E")


@examples(PROBLEM)
@given(case=router_cases())
def test_losses(student, reference, case):
    routing = Routing(student, reference, case)
    routing.check_close("balance_loss")
    routing.check_close("z_loss")


@examples(PROBLEM)
@given(case=router_cases())
def test_gradients(student, reference, case):
    Routing(student, reference, case).check_gradients()


@examples(PROBLEM)
@given(case=router_cases(dtypes=low_precision_dtypes))
def test_low_precision_inputs(student, reference, case):
    """bfloat16 and float16 inputs: the outputs are float32, computed from inputs cast to float32, and the gradients
    arrive in each input's dtype."""
    routing = Routing(student, reference, case)
    # Floating outputs first: their errors show a low-precision computation directly, a changed choice only by chance.
    for name in ("gate_TK", "balance_loss", "z_loss"):
        routing.check_close(name)
    for name in ("expert_index_TK", "tokens_per_expert_E"):
        routing.check_equal(name)
    routing.check_gradients()


INVALID = [
    pytest.param((3, 4), torch.float32, (5, 4), torch.float32, 0, "ValueError", id="k=0"),
    pytest.param((3, 4), torch.float32, (5, 4), torch.float32, 6, "ValueError", id="k>E"),
    pytest.param((3, 4), torch.float32, (5, 3), torch.float32, 2, "ValueError", id="D-mismatch"),
    pytest.param((4,), torch.float32, (5, 4), torch.float32, 2, "ValueError", id="1-D-x"),
    pytest.param((2, 3, 4), torch.float32, (5, 4), torch.float32, 2, "ValueError", id="3-D-x"),
    pytest.param((3, 4), torch.float32, (4,), torch.float32, 1, "ValueError", id="1-D-weight"),
    pytest.param((0, 4), torch.float32, (5, 4), torch.float32, 2, "ValueError", id="T=0"),
    pytest.param((3, 4), torch.int64, (5, 4), torch.float32, 2, "TypeError", id="int64-x"),
    pytest.param((3, 4), torch.float32, (5, 4), torch.int32, 2, "TypeError", id="int32-weight"),
]


@pytest.mark.parametrize("x_shape, x_dtype, weight_shape, weight_dtype, k, expected_error", INVALID)
def test_invalid_arguments(student, x_shape, x_dtype, weight_shape, weight_dtype, k, expected_error):
    device = current().device
    x_TD = torch.ones(x_shape, dtype=x_dtype, device=device)
    weight_ED = torch.ones(weight_shape, dtype=weight_dtype, device=device)
    assert_raises(
        student.raises("topk_route", x_TD, weight_ED, k, True), expected_error,
        f"topk_route(x_TD, router_weight_ED, k={k}) for x_TD of shape {x_shape} and {x_dtype}, router_weight_ED "
        f"of shape {weight_shape} and {weight_dtype}",
    )
