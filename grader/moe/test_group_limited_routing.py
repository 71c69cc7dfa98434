"""Grading moe.group_limited_routing: top-M groups by the sum of their two best affinities, then top-k experts
within them, gated by renormalised sigmoid affinities.

Integer outputs (kept groups, chosen experts) must equal the fast reference's. Gates and gradients are measured
against the plain reference in float64, allowing a multiple of the fast reference's own error plus a floor set by
how exactly any float32 computation can get them. Tokens whose group scores or eligible affinities are nearly tied
where it matters are dropped from the random inputs; exact ties are graded separately, on integer logits.
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
from grader.moe.routing_checks import RoutingCase, SigmoidGating, clearly_ordered
from grader.session.context import current

PROBLEM = BY_ID["moe.group_limited_routing"]
FIELDS = ("group_index_TM", "expert_index_TK", "gate_TK")
LOGIT_SCALES = (0.25, 1.0, 4.0, 12.0)
ROUTE_SCALES = (1.0, 2.5)
X_OFFSETS = (0, -40)
DTYPES = (torch.float32, torch.float32, torch.bfloat16, torch.float16)


def group_scores(affinity_TE: torch.Tensor, num_groups: int) -> torch.Tensor:
    """float64 [T, G]: the sum of each contiguous group's two largest affinities (its only one if S == 1)."""
    grouped_TGS = affinity_TE.view(affinity_TE.shape[0], num_groups, -1)
    return grouped_TGS.sort(dim=-1, descending=True).values[..., :2].sum(dim=-1)


@dataclass(frozen=True)
class GroupCase(RoutingCase):
    """One routing problem, built deterministically from its fields: its description is a recipe to reproduce it.

    values: "normal" draws Gaussian x and weight (logits of standard deviation logit_scale) and keeps the first
    `tokens` of twice as many drawn tokens whose choices are not nearly tied: the M + 1 best group scores, and the
    k + 1 best affinities within the kept groups, are clearly ordered. "identity" draws x in [0, 3] with the
    identity as weight (D == E): logits are the integers 0 to 3, so equal affinities and equal group scores are
    exactly equal and different ones far apart; x_offset shifts them (-40: affinities of 4e-18 to 9e-17, which
    differ by far less than an ulp of 1).
    """

    tokens: int
    width: int
    num_groups: int
    group_size: int
    groups_per_token: int
    k: int
    route_scale: float
    values: str = "normal"
    x_dtype: torch.dtype = torch.float32
    weight_dtype: torch.dtype = torch.float32
    x_layout: str = "contiguous"
    weight_layout: str = "contiguous"
    logit_scale: float = 1.0
    seed: int = 0
    x_offset: int = 0

    @property
    def experts(self) -> int:
        return self.num_groups * self.group_size

    def exact_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x_TD and router_weight_ED in float64, holding exactly the values the student receives."""
        generator = torch.Generator().manual_seed(self.seed)
        if self.values == "normal":
            x_TD, weight_ED = self.normal_draw(generator)
        else:
            x_TD = torch.randint(0, 4, (self.tokens, self.experts), generator=generator).double() + self.x_offset
            weight_ED = torch.eye(self.experts, dtype=torch.float64)
        x_TD, weight_ED = self.as_received(x_TD, weight_ED)
        if self.values == "normal":
            affinity_TE = torch.sigmoid(x_TD @ weight_ED.T)
            # A float32 affinity is off by about (max_e sum_d |x_d w_ed| + 1) ulps; a group score by twice that.
            uncertainty_T = (x_TD.abs() @ weight_ED.abs().T).amax(dim=-1) + 2
            score_TG = group_scores(affinity_TE, self.num_groups)
            groups_clear_T = clearly_ordered(score_TG, self.groups_per_token, 2 * uncertainty_T)
            kept_TG = torch.zeros_like(score_TG, dtype=torch.bool)
            kept_TG.scatter_(1, score_TG.topk(self.groups_per_token, dim=-1).indices, True)
            eligible_TE = kept_TG.repeat_interleave(self.group_size, dim=1)
            masked_TE = affinity_TE.masked_fill(~eligible_TE, float("-inf"))
            experts_clear_T = clearly_ordered(masked_TE, self.k, uncertainty_T)
            x_TD = x_TD[groups_clear_T & experts_clear_T][: self.tokens]
        return x_TD, weight_ED

    def describe(self, x_TD: torch.Tensor) -> str:
        values = self.values
        if values == "normal":
            values = self.normal_described()
        elif self.x_offset:
            values = f"identity, x_TD in [{self.x_offset}, {self.x_offset + 3}]"
        return (
            f"T={x_TD.shape[0]}, D={self.width}, E={self.experts} in G={self.num_groups} groups of "
            f"S={self.group_size}, M={self.groups_per_token}, k={self.k}, route_scale={self.route_scale:g}, "
            f"values={values}, {self.layouts_described()}, seed={self.seed}"
        ) + inputs_if_small(x_TD=x_TD)


@st.composite
def group_cases(draw, values: str = "normal") -> GroupCase:
    num_groups = draw(dims(8 * min(size_scale(), 2), tiles=(4, 8)))
    group_size = draw(dims(8 * min(size_scale(), 2), tiles=(4, 8)))
    groups_per_token = draw(st.integers(1, num_groups))
    dtypes = (torch.float32,) if values == "identity" else DTYPES
    return GroupCase(
        tokens=draw(dims(48 * size_scale())),
        width=num_groups * group_size if values == "identity" else draw(dims(48 * size_scale())),
        num_groups=num_groups,
        group_size=group_size,
        groups_per_token=groups_per_token,
        k=draw(st.integers(1, groups_per_token * group_size)),
        route_scale=draw(st.sampled_from(ROUTE_SCALES)),
        values=values,
        x_dtype=draw(st.sampled_from(dtypes)),
        weight_dtype=draw(st.sampled_from(dtypes)),
        x_layout=draw(st.sampled_from(LAYOUTS)),
        weight_layout=draw(st.sampled_from(LAYOUTS)),
        logit_scale=draw(st.sampled_from(LOGIT_SCALES)),
        seed=draw(st.integers(0, 2**31 - 1)),
        x_offset=draw(st.sampled_from(X_OFFSETS)) if values == "identity" else 0,
    )


class Routing(SigmoidGating):
    """group_limited_route on one case."""

    problem, function, fields = PROBLEM, "group_limited_route", FIELDS

    def options(self) -> tuple:
        return (self.case.num_groups, self.case.groups_per_token, self.case.k, self.case.route_scale)


@examples(PROBLEM)
@given(case=group_cases())
def test_groups_and_experts(student, reference, case):
    routing = Routing(student, reference, case)
    routing.check_equal("group_index_TM")
    routing.check_equal("expert_index_TK")


@examples(PROBLEM)
@given(case=group_cases())
def test_gates(student, reference, case):
    Routing(student, reference, case).check_gates()


@examples(PROBLEM)
# Affinities far below an ulp of 1, in every profile.
@example(case=GroupCase(tokens=12, width=8, num_groups=4, group_size=2, groups_per_token=2, k=3, route_scale=1.0,
                        values="identity", x_offset=-40))
@given(case=group_cases(values="identity"))
def test_tie_breaking(student, reference, case):
    """Exactly equal group scores and affinities: the lower group index and the lower expert index rank first."""
    routing = Routing(student, reference, case)
    routing.check_equal("group_index_TM")
    routing.check_equal("expert_index_TK")


@examples(PROBLEM, 0.5)
@given(case=group_cases())
def test_gradients(student, reference, case):
    Routing(student, reference, case).check_gradients()


INVALID = [
    pytest.param((3, 4), (6, 4), 4, 1, 1, 1.0, "ValueError", id="G-does-not-divide-E"),
    pytest.param((3, 4), (6, 4), 0, 1, 1, 1.0, "ValueError", id="G=0"),
    pytest.param((3, 4), (6, 4), 3, 0, 1, 1.0, "ValueError", id="M=0"),
    pytest.param((3, 4), (6, 4), 3, 4, 1, 1.0, "ValueError", id="M>G"),
    pytest.param((3, 4), (6, 4), 3, 2, 5, 1.0, "ValueError", id="k>M*S"),
    pytest.param((3, 4), (6, 4), 3, 2, 0, 1.0, "ValueError", id="k=0"),
    pytest.param((3, 4), (6, 4), 3, 2, 2, -1.0, "ValueError", id="route_scale<0"),
    pytest.param((3, 4), (6, 3), 3, 2, 2, 1.0, "ValueError", id="D-mismatch"),
    pytest.param((0, 4), (6, 4), 3, 2, 2, 1.0, "ValueError", id="T=0"),
    pytest.param((3, 4), (6,), 3, 2, 2, 1.0, "ValueError", id="1-D-weight"),
    pytest.param((3, 4), "int64", 3, 2, 2, 1.0, "TypeError", id="int64-weight"),
]


@pytest.mark.parametrize("x_shape, weight_shape, num_groups, groups_per_token, k, route_scale, expected_error", INVALID)
def test_invalid_arguments(student, x_shape, weight_shape, num_groups, groups_per_token, k, route_scale,
                           expected_error):
    device = current().device
    x_TD = torch.ones(x_shape, device=device)
    if weight_shape == "int64":
        weight_shape = (6, 4)
        weight_ED = torch.ones(weight_shape, dtype=torch.int64, device=device)
    else:
        weight_ED = torch.ones(weight_shape, device=device)
    assert_raises(
        student.raises("group_limited_route", x_TD, weight_ED, num_groups, groups_per_token, k, route_scale),
        expected_error,
        f"group_limited_route(x_TD, router_weight_ED, num_groups={num_groups}, groups_per_token={groups_per_token}, "
        f"k={k}, route_scale={route_scale}) for x_TD of shape {x_shape}, router_weight_ED of shape {weight_shape} "
        f"and {weight_ED.dtype}",
    )
