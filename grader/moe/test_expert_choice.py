"""Grading moe.expert_choice: expert-choice routing (each expert takes its top-C tokens), in plain PyTorch.

Integer outputs (chosen tokens, counts) must equal the fast reference's at float32. Gates and their gradients are
measured against the plain reference in float64, allowing a multiple of the fast reference's own float32 error plus
a floor set by how exactly any float32 computation can get them. Each expert compares probabilities of different
tokens, which two correct float32 computations may order differently where they nearly tie: random inputs leave out
tokens that a saturated softmax makes nearly equal, and examples whose deciding comparisons are nearly tied are not
used. Exact ties are graded separately, on inputs whose tied probabilities every computation gets exactly equal:
zero (padding) tokens, a zero router, a single expert. (Identical non-zero tokens would not do: a reduction may round
identical rows differently depending on where they lie in memory.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_raises, inputs_if_small
from grader.checks.outcomes import WrongAnswer
from grader.checks.profiles import examples
from grader.checks.strategies import dims, size_scale
from grader.moe.routing_checks import (
    FLOAT32_EPS,
    TIE_MARGIN_ULPS,
    RoutingCase,
    RoutingCheck,
    dtype_name,
    low_precision_dtypes,
    router_term_scales,
)
from grader.session.context import current

PROBLEM = BY_ID["moe.expert_choice"]
FIELDS = ("token_index_EC", "gate_EC", "experts_per_token_T")
# Tokens whose largest probability is within this of 1 are left out: float32 cannot tell such tokens apart.
SATURATION = 2.0**-10
# Standard deviations of the logits of Gaussian inputs.
LOGIT_SCALES = (0.25, 1.0, 4.0)
# Multiples of 1/4, so that capacity_factor * T / E is computed exactly enough that its floor is unambiguous; the
# smallest clamp C to 1, the largest to T.
CAPACITY_FACTORS = (0.25, 0.5, 1.0, 1.25, 2.0, 3.0, 64.0)


def uncertainty(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """float64 [T]: a float32 log-probability of token t is exact to about this many ulps whatever the algorithm:
    its logit to a few ulps of max_e sum_d |x_d w_ed|, and its log-sum-exp to a few ulps of itself."""
    logits_TE = x_TD @ weight_ED.T
    return 1 + (x_TD.abs() @ weight_ED.abs().T).amax(dim=-1) + torch.logsumexp(logits_TE, dim=-1).abs()


def choices_are_separated(x_TD: torch.Tensor, weight_ED: torch.Tensor, c: int) -> bool:
    """Whether every expert's C+1 most probable tokens are clearly ordered, by TIE_MARGIN_ULPS ulps of the larger of
    two neighbours' uncertainties (exactly equal probabilities aside: those come from zero tokens, a zero router or
    a single expert, and every computation gives them the same value)."""
    log_probs_ET = torch.log_softmax(x_TD @ weight_ED.T, dim=-1).T
    top = min(c + 1, x_TD.shape[0])
    sorted_ET, tokens_ET = log_probs_ET.sort(dim=-1, descending=True)
    sorted_ET, tokens_ET = sorted_ET[:, :top], tokens_ET[:, :top]
    margin_T = TIE_MARGIN_ULPS * FLOAT32_EPS * uncertainty(x_TD, weight_ED)
    margin_ET = torch.maximum(margin_T[tokens_ET[:, :-1]], margin_T[tokens_ET[:, 1:]])
    gaps_ET = sorted_ET[:, :-1] - sorted_ET[:, 1:]
    normal = bool((sorted_ET[:, :c] > torch.log(torch.tensor(torch.finfo(torch.float32).tiny))).all())
    return bool(((gaps_ET == 0) | (gaps_ET > margin_ET)).all()) and normal


@dataclass(frozen=True)
class ExpertChoiceCase(RoutingCase):
    """One routing problem, built deterministically from its fields: its description is a recipe to reproduce it.

    values: "normal" draws 2 T Gaussian tokens and a Gaussian router scaled so that the logits' standard deviation
    is logit_scale, and keeps the first T tokens whose largest probability is not within SATURATION of 1 (with
    E == 1 every probability is exactly 1: all are kept); "padding" does the same and then replaces each token by
    zeros with probability padding (zero tokens tie exactly, at 1/E); "zeros" uses a zero router (every
    probability is exactly 1/E).
    """

    tokens: int
    width: int
    experts: int
    capacity_factor: float
    values: str = "normal"
    padding: float = 0.5
    x_dtype: torch.dtype = torch.float32
    weight_dtype: torch.dtype = torch.float32
    transposed: bool = False
    logit_scale: float = 1.0
    seed: int = 0

    def exact_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x_TD and router_weight_ED in float64 on the CPU, holding exactly the values the student receives."""
        generator = torch.Generator().manual_seed(self.seed)
        x_TD, weight_ED = self.normal_draw(generator)
        if self.values == "zeros":
            weight_ED = torch.zeros_like(weight_ED)
        x_TD, weight_ED = self.as_received(x_TD, weight_ED)
        unsaturated_T = torch.softmax(x_TD @ weight_ED.T, dim=-1).amax(dim=-1) <= 1 - SATURATION
        x_TD = x_TD[unsaturated_T | (self.values == "zeros") | (self.experts == 1)][: self.tokens]
        if self.values == "padding":
            padded_T = torch.rand(x_TD.shape[0], generator=generator, dtype=torch.float64) < self.padding
            x_TD = torch.where(padded_T[:, None], 0.0, x_TD)
        return x_TD, weight_ED

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_TD, router_weight_ED) in the case's dtypes, layout and device; an example whose choices are nearly
        tied, or that has no token left, is not used."""
        x_TD, weight_ED = self.exact_inputs()
        assume(x_TD.shape[0] > 0 and choices_are_separated(x_TD, weight_ED, self.capacity(x_TD.shape[0])))
        return self.laid_out_inputs(x_TD, weight_ED)

    @property
    def x_layout(self) -> str:
        """Both inputs are transposed views or both contiguous: two of grader.checks.strategies.LAYOUTS."""
        return "transposed" if self.transposed else "contiguous"

    weight_layout = x_layout

    def capacity(self, tokens: int) -> int:
        return min(tokens, max(1, math.floor(self.capacity_factor * tokens / self.experts)))

    def describe(self, x_TD: torch.Tensor) -> str:
        values = {
            "normal": f"normal with logit scale {self.logit_scale:g}, of {2 * self.tokens} tokens the first "
                      "unsaturated ones",
            "padding": f"normal with logit scale {self.logit_scale:g}, of {2 * self.tokens} tokens the first "
                       f"unsaturated ones, each zeroed with probability {self.padding:g}",
            "zeros": "normal tokens, zero router",
        }[self.values]
        return (
            f"T={x_TD.shape[0]}, D={self.width}, E={self.experts}, capacity_factor={self.capacity_factor:g} "
            f"(C={self.capacity(x_TD.shape[0])}), values={values}, x_TD {dtype_name(self.x_dtype)}, "
            f"router_weight_ED {dtype_name(self.weight_dtype)}, {self.x_layout}, seed={self.seed}"
        ) + inputs_if_small(x_TD=x_TD)


@st.composite
def expert_choice_cases(
    draw,
    values: tuple[str, ...] = ("normal",),
    dtypes: st.SearchStrategy[tuple[torch.dtype, torch.dtype]] = st.just((torch.float32, torch.float32)),
    capacity_factors: tuple[float, ...] = CAPACITY_FACTORS,
) -> ExpertChoiceCase:
    x_dtype, weight_dtype = draw(dtypes)
    return ExpertChoiceCase(
        tokens=draw(dims(64 * size_scale())),
        width=draw(dims(32 * size_scale())),
        experts=draw(dims(16 * size_scale(), tiles=(8, 16, 32))),
        capacity_factor=draw(st.sampled_from(capacity_factors)),
        values=draw(st.sampled_from(values)),
        padding=draw(st.sampled_from((0.25, 0.5, 0.9))),
        x_dtype=x_dtype,
        weight_dtype=weight_dtype,
        transposed=draw(st.booleans()),
        logit_scale=draw(st.sampled_from(LOGIT_SCALES)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


class Routing(RoutingCheck):
    """expert_choice_route on one case."""

    problem, function, fields, output = PROBLEM, "expert_choice_route", FIELDS, "an ExpertChoiceOutput"
    differentiable = ("gate_EC",)

    def __init__(self, student, reference, case: ExpertChoiceCase):
        super().__init__(student, reference, case)
        self.uncertainty_T = uncertainty(self.x_TD.double().cpu(), self.weight_ED.double().cpu())

    def options(self) -> tuple:
        return (self.case.capacity_factor,)

    def check_capacity(self) -> None:
        """The number of tokens per expert, C, said as such rather than as a shape mismatch."""
        actual = self.actual["token_index_EC"]
        expected_shape = tuple(self.at_dtype["token_index_EC"].shape)
        if isinstance(actual, torch.Tensor) and tuple(actual.shape) != expected_shape:
            tokens = self.x_TD.shape[0]
            raise WrongAnswer(
                f"token_index_EC: shape {tuple(actual.shape)}, expected {expected_shape}: C = min(T, max(1, "
                f"floor({self.case.capacity_factor:g} x T={tokens} / E={self.case.experts}))) = {expected_shape[1]}"
                f" ({self.context})"
            )

    def check_gates(self) -> None:
        self.check_floating("gate_EC", float(self.exact["gate_EC"].abs().max()) * float(self.uncertainty_T.max()))

    def gradient_term_scales(self, field: str, upstream_EC: torch.Tensor) -> tuple[float, float]:
        """How large the terms are that a backward pass sums into each input's gradient: token t's share is about
        the upstream gradient reaching its chosen probabilities, G_t, each term uncertain by about U_t ulps."""
        tokens = self.x_TD.shape[0]
        reaching_T = torch.zeros(tokens, dtype=torch.float64)
        chosen_N = self.exact["token_index_EC"].cpu().flatten()
        reaching_T.index_add_(0, chosen_N, upstream_EC.double().cpu().abs().flatten())
        return router_term_scales(reaching_T * self.uncertainty_T, self.x_TD, self.weight_ED)


@examples(PROBLEM)
@given(case=expert_choice_cases())
def test_tokens_and_gates(student, reference, case):
    routing = Routing(student, reference, case)
    routing.check_capacity()
    routing.check_equal("token_index_EC")
    routing.check_gates()


@examples(PROBLEM, 0.5)
@given(case=expert_choice_cases(capacity_factors=(0.25, 1.25, 3.0, 64.0)))
def test_capacity(student, reference, case):
    """Capacity factors whose C is rounded down (1.25 and 3 with most T / E) or clamped to 1 or to T."""
    Routing(student, reference, case).check_capacity()


@examples(PROBLEM)
@given(case=expert_choice_cases(values=("padding", "zeros")))
def test_tie_breaking(student, reference, case):
    """Exactly equal probabilities: each expert takes equal ones by ascending token index."""
    routing = Routing(student, reference, case)
    routing.check_capacity()
    routing.check_equal("token_index_EC")


@examples(PROBLEM, 0.5)
@given(case=expert_choice_cases(values=("normal", "padding")))
def test_experts_per_token(student, reference, case):
    routing = Routing(student, reference, case)
    routing.check_capacity()
    routing.check_equal("experts_per_token_T")


@examples(PROBLEM)
@given(case=expert_choice_cases())
def test_gradients(student, reference, case):
    Routing(student, reference, case).check_gradients()


@examples(PROBLEM, 0.5)
@given(case=expert_choice_cases(dtypes=low_precision_dtypes))
def test_low_precision_inputs(student, reference, case):
    """bfloat16 and float16 inputs: gates are float32, computed from inputs cast to float32, and the gradients
    arrive in each input's dtype."""
    routing = Routing(student, reference, case)
    routing.check_capacity()
    routing.check_gates()
    routing.check_equal("token_index_EC")
    routing.check_gradients()


INVALID = [
    pytest.param((3, 4), torch.float32, (2, 4), torch.float32, 0.0, "ValueError", id="capacity_factor=0"),
    pytest.param((3, 4), torch.float32, (2, 4), torch.float32, -1.0, "ValueError", id="capacity_factor<0"),
    pytest.param((3, 4), torch.float32, (2, 5), torch.float32, 1.0, "ValueError", id="D-mismatch"),
    pytest.param((0, 4), torch.float32, (2, 4), torch.float32, 1.0, "ValueError", id="T=0"),
    pytest.param((3, 4), torch.float32, (0, 4), torch.float32, 1.0, "ValueError", id="E=0"),
    pytest.param((4,), torch.float32, (2, 4), torch.float32, 1.0, "ValueError", id="1-D-x"),
    pytest.param((3, 4), torch.float32, (1, 2, 4), torch.float32, 1.0, "ValueError", id="3-D-weight"),
    pytest.param((3, 4), torch.int64, (2, 4), torch.float32, 1.0, "TypeError", id="int64-x"),
    pytest.param((3, 4), torch.float32, (2, 4), torch.int32, 1.0, "TypeError", id="int32-weight"),
]


@pytest.mark.parametrize("x_shape, x_dtype, weight_shape, weight_dtype, capacity_factor, expected_error", INVALID)
def test_invalid_arguments(student, x_shape, x_dtype, weight_shape, weight_dtype, capacity_factor, expected_error):
    device = current().device
    x_TD = torch.ones(x_shape, dtype=x_dtype, device=device)
    weight_ED = torch.ones(weight_shape, dtype=weight_dtype, device=device)
    assert_raises(
        student.raises("expert_choice_route", x_TD, weight_ED, capacity_factor), expected_error,
        f"expert_choice_route(x_TD, router_weight_ED, capacity_factor={capacity_factor}) for x_TD of shape "
        f"{x_shape} and {x_dtype}, router_weight_ED of shape {weight_shape} and {weight_dtype}",
    )
