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
from grader.checks.compare import assert_equal, assert_raises, inputs_if_small
from grader.checks.outcomes import WrongAnswer
from grader.checks.profiles import examples
from grader.checks.strategies import dims, size_scale
from grader.moe.routing_checks import compare_floating, compare_gradients, router_term_scales
from grader.session.context import current

PROBLEM = BY_ID["moe.expert_choice"]
FIELDS = ("token_index_EC", "gate_EC", "experts_per_token_T")
FLOAT32_EPS = torch.finfo(torch.float32).eps
# Log-probabilities compared by an expert must differ by this many float32 ulps of the larger of the two tokens'
# uncertainties (see Uncertainty): several times the rounding error of any reasonable float32 computation.
TIE_MARGIN_ULPS = 16
# Tokens whose largest probability is within this of 1 are left out: float32 cannot tell such tokens apart.
SATURATION = 2.0**-10
# Standard deviations of the logits of Gaussian inputs.
LOGIT_SCALES = (0.25, 1.0, 4.0)
# Multiples of 1/4, so that capacity_factor * T / E is computed exactly enough that its floor is unambiguous; the
# smallest clamp C to 1, the largest to T.
CAPACITY_FACTORS = (0.25, 0.5, 1.0, 1.25, 2.0, 3.0, 64.0)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def uncertainty(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """float64 [T]: a float32 log-probability of token t is exact to about this many ulps whatever the algorithm:
    its logit to a few ulps of max_e sum_d |x_d w_ed|, and its log-sum-exp to a few ulps of itself."""
    logits_TE = x_TD @ weight_ED.T
    return 1 + (x_TD.abs() @ weight_ED.abs().T).amax(dim=-1) + torch.logsumexp(logits_TE, dim=-1).abs()


def choices_are_separated(x_TD: torch.Tensor, weight_ED: torch.Tensor, c: int) -> bool:
    """Whether every expert's C+1 most probable tokens are clearly ordered (exactly equal probabilities aside: those
    come from zero tokens, a zero router or a single expert, and every computation gives them the same value)."""
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
class ExpertChoiceCase:
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
        x_TD = torch.randn(2 * self.tokens, self.width, generator=generator, dtype=torch.float64)
        weight_ED = torch.randn(self.experts, self.width, generator=generator, dtype=torch.float64)
        weight_ED = weight_ED * (self.logit_scale / self.width**0.5)
        if self.values == "zeros":
            weight_ED = torch.zeros_like(weight_ED)
        x_TD = x_TD.to(self.x_dtype).double()
        weight_ED = weight_ED.to(self.weight_dtype).double()
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
        assume(x_TD.shape[0] > 0)
        assume(choices_are_separated(x_TD, weight_ED, self.capacity(x_TD.shape[0])))
        x_TD, weight_ED = x_TD.to(self.x_dtype), weight_ED.to(self.weight_dtype)
        if self.transposed:
            x_TD, weight_ED = x_TD.T.contiguous().T, weight_ED.T.contiguous().T
        device = current().device
        return x_TD.to(device), weight_ED.to(device)

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
            f"(C={self.capacity(x_TD.shape[0])}), values={values}, x_TD {str(self.x_dtype).removeprefix('torch.')}, "
            f"router_weight_ED {str(self.weight_dtype).removeprefix('torch.')}, "
            f"{'transposed' if self.transposed else 'contiguous'}, seed={self.seed}"
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




class Routing:
    """The student's routing of one case, the fast reference's at the case's dtypes and the plain one's in
    float64."""

    def __init__(self, student, reference, case: ExpertChoiceCase):
        self.student, self.reference, self.case = student, reference, case
        self.x_TD, self.weight_ED = case.inputs()
        self.context = case.describe(self.x_TD)
        with student.describing(self.context):
            value = student.call("expert_choice_route", self.x_TD, self.weight_ED, case.capacity_factor)
        if not isinstance(value, tuple) or len(value) != len(FIELDS):
            raise WrongAnswer(f"expert_choice_route must return an ExpertChoiceOutput of {len(FIELDS)} fields, got "
                              f"{value!r:.200} ({self.context})")
        self.actual = dict(zip(FIELDS, value))
        with torch.no_grad():
            self.at_dtype = dict(zip(FIELDS, reference.expert_choice_route(self.x_TD, self.weight_ED,
                                                                           case.capacity_factor)))
            self.exact = dict(zip(FIELDS, reference.expert_choice_route_torch(
                self.x_TD.double(), self.weight_ED.double(), case.capacity_factor)))
        self.uncertainty_T = uncertainty(self.x_TD.double().cpu(), self.weight_ED.double().cpu())

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

    def check_equal(self, name: str) -> None:
        assert_equal(self.actual[name], self.at_dtype[name], what=name, context=self.context)

    def check_gates(self) -> None:
        floor_scale = float(self.exact["gate_EC"].abs().max()) * float(self.uncertainty_T.max())
        compare_floating(self.actual["gate_EC"], self.exact["gate_EC"], self.at_dtype["gate_EC"], floor_scale,
                         PROBLEM, "gate_EC", self.context)

    def check_gradients(self) -> None:
        generator = torch.Generator().manual_seed(self.case.seed + 1)
        shape = self.exact["gate_EC"].shape
        upstream_EC = torch.randn(shape, generator=generator, dtype=torch.float64).float().to(current().device)
        grad = {"inputs": [0, 1], "upstream": [None, upstream_EC, None]}
        with self.student.describing(self.context):
            actual = self.student.call_traced("expert_choice_route", self.x_TD, self.weight_ED,
                                              self.case.capacity_factor, grad=grad)["grads"]
        exact = self.reference_gradients(self.reference.expert_choice_route_torch, self.x_TD.double(),
                                         self.weight_ED.double(), upstream_EC)
        at_dtype = self.reference_gradients(self.reference.expert_choice_route, self.x_TD, self.weight_ED,
                                            upstream_EC)
        compare_gradients(actual, exact, at_dtype, ("x_TD", "router_weight_ED"), self.gradient_term_scales(upstream_EC),
                          PROBLEM, " from gate_EC", self.context)

    def reference_gradients(self, route, x_TD, weight_ED, upstream_EC):
        x_TD = x_TD.detach().requires_grad_(True)
        weight_ED = weight_ED.detach().requires_grad_(True)
        gate_EC = route(x_TD, weight_ED, self.case.capacity_factor).gate_EC
        gate_EC.backward(upstream_EC.to(gate_EC.dtype))
        return x_TD.grad, weight_ED.grad

    def gradient_term_scales(self, upstream_EC: torch.Tensor) -> tuple[float, float]:
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


low_precision_dtypes = st.tuples(
    st.sampled_from(LOW_PRECISION), st.sampled_from((*LOW_PRECISION, torch.float32))
).flatmap(lambda pair: st.sampled_from((pair, pair[::-1])))


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
