"""Grading moe.bias_balancing: loads under biased top-k selection and the sign update of the bias.

Every output is exact: loads are integers, the selection scores are float32 sums (equal for every implementation
that follows the contract), and each new bias is one float32 addition. So both outputs must equal the reference's
bit for bit, and exact ties among selection scores need no special care.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_equal, assert_raises
from grader.checks.profiles import examples
from grader.checks.strategies import LAYOUTS, dims, size_scale
from grader.moe.routing_checks import dtype_name, laid_out, returned_fields
from grader.session.context import current

PROBLEM = BY_ID["moe.bias_balancing"]
FIELDS = ("tokens_per_expert_E", "expert_bias_E")
# Step sizes, each exactly a float32 (so rounding it first or not cannot matter): the published 1e-3 among them.
UPDATE_RATES = tuple(float(torch.tensor(rate, dtype=torch.float32)) for rate in (1e-3, 1e-2, 2**-7, 0.25, 0.0))
SCORE_DTYPES = (torch.float32, torch.float32, torch.bfloat16, torch.float16)
MAGNITUDES = (1.0, 2.0**-40)


def signed_quarters(shape: tuple[int, ...], limit: int, generator: torch.Generator) -> torch.Tensor:
    """Multiples of 1/4 in [-limit/4, limit/4], a quarter of them (or more) zeros, each zero of a random sign."""
    quarters_X = torch.randint(-limit, limit + 1, shape, generator=generator) / 4
    zero_X = torch.rand(shape, generator=generator) < 0.25
    negative_X = torch.rand(shape, generator=generator) < 0.5
    return torch.where(zero_X | (quarters_X == 0), torch.where(negative_X, -0.0, 0.0), quarters_X)


@dataclass(frozen=True)
class BalancingCase:
    """One balancing step, built deterministically from its fields: its description is a recipe to reproduce it.

    values: "affinities" draws sigmoid affinities of Gaussian logits and a Gaussian bias of standard deviation 0.05;
    "ties" draws scores in {0, 1/4, ..., 1} and a bias in {-1/4, -1/8, ..., 1/4}, so many selection scores are
    exactly equal; "cyclic" gives token t score 1 for the k experts perm[(t + j) % E], j < k, and 0 for the others,
    with a bias in (-1/2, 1/2) that cannot change the choice: every expert's load is then within one of the mean,
    and with T * k divisible by E many loads are exactly at it; "signed" draws scores in {-6, -23/4, ..., 6} and a
    bias in {-1/2, ..., 1/2}, every zero among them signed at random (-0.0 equals 0.0: a tie), all times
    `magnitude`: beyond +-2 a score's float32 bits use all 31 bits of an int32, and at magnitude 2**-40 scores
    differ by far less than an ulp of 1.
    """

    tokens: int
    experts: int
    k: int
    update_rate: float
    values: str = "affinities"
    scores_dtype: torch.dtype = torch.float32
    layout: str = "contiguous"
    seed: int = 0
    magnitude: float = 1.0

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        shape = (self.tokens, self.experts)
        if self.values == "affinities":
            scores_TE = torch.sigmoid(2 * torch.randn(shape, generator=generator))
            bias_E = 0.05 * torch.randn(self.experts, generator=generator)
        elif self.values == "signed":
            scores_TE = signed_quarters(shape, 24, generator) * self.magnitude
            bias_E = signed_quarters((self.experts,), 2, generator) * self.magnitude
        elif self.values == "ties":
            scores_TE = torch.randint(0, 5, shape, generator=generator) / 4
            bias_E = torch.randint(-2, 3, (self.experts,), generator=generator) / 8
        else:
            permutation_E = torch.randperm(self.experts, generator=generator)
            offset_TE = (torch.arange(self.experts) - torch.arange(self.tokens)[:, None]) % self.experts
            scores_TE = (offset_TE < self.k).float()[:, permutation_E.argsort()]
            bias_E = torch.rand(self.experts, generator=generator) - 0.5
        device = current().device
        return laid_out(scores_TE.to(device, self.scores_dtype), self.layout), bias_E.float().to(device)

    def describe(self) -> str:
        return (
            f"T={self.tokens}, E={self.experts}, k={self.k}, update_rate={self.update_rate!r}, values={self.values}"
            f"{f' times {self.magnitude!r}' if self.magnitude != 1.0 else ''}, "
            f"scores_TE {dtype_name(self.scores_dtype)} {self.layout}, expert_bias_E float32, seed={self.seed}"
        )


@st.composite
def balancing_cases(draw, values: tuple[str, ...] = ("affinities", "ties", "cyclic", "signed")) -> BalancingCase:
    kind = draw(st.sampled_from(values))
    experts = draw(dims(64 * min(size_scale(), 4), tiles=(8, 16, 32, 64)))
    k = draw(st.integers(1, experts))
    tokens = draw(dims(96 * size_scale()))
    if kind == "cyclic":
        # A multiple of E / gcd(E, k) tokens makes the mean load T * k / E an integer.
        unit = experts // math.gcd(experts, k)
        tokens = unit * max(1, tokens // unit)
    return BalancingCase(
        tokens=tokens,
        experts=experts,
        k=k,
        update_rate=draw(st.sampled_from(UPDATE_RATES)),
        values=kind,
        scores_dtype=draw(st.sampled_from(SCORE_DTYPES)),
        layout=draw(st.sampled_from(LAYOUTS)),
        seed=draw(st.integers(0, 2**31 - 1)),
        magnitude=draw(st.sampled_from(MAGNITUDES)) if kind == "signed" else 1.0,
    )


def check_step(student, reference, case: BalancingCase, names: tuple[str, ...]) -> None:
    scores_TE, bias_E = case.inputs()
    context = case.describe()
    with student.describing(context):
        value = student.call("update_expert_bias", scores_TE, bias_E, case.k, case.update_rate)
    actual = returned_fields(value, FIELDS, "update_expert_bias", context)
    expected = dict(zip(FIELDS, reference.update_expert_bias(scores_TE, bias_E, case.k, case.update_rate)))
    for name in names:
        assert_equal(actual[name], expected[name], what=name, context=context)


@examples(PROBLEM)
# Signed scores beyond +-2 with signed zeros, and the same scaled far below an ulp of 1, in every profile.
@example(case=BalancingCase(tokens=24, experts=8, k=3, update_rate=UPDATE_RATES[0], values="signed", seed=1))
@example(case=BalancingCase(tokens=24, experts=8, k=3, update_rate=UPDATE_RATES[0], values="signed", seed=1,
                            magnitude=2.0**-40))
@given(case=balancing_cases())
def test_loads(student, reference, case):
    check_step(student, reference, case, ("tokens_per_expert_E",))


@examples(PROBLEM)
@given(case=balancing_cases())
def test_bias_update(student, reference, case):
    check_step(student, reference, case, FIELDS)


@examples(PROBLEM)
@given(case=balancing_cases(values=("cyclic",)))
def test_experts_at_the_mean(student, reference, case):
    """Loads within one of an integer mean: an expert exactly at the mean keeps its bias."""
    check_step(student, reference, case, FIELDS)


INVALID = [
    pytest.param((3, 5), (5,), 0, 1e-3, torch.float32, "ValueError", id="k=0"),
    pytest.param((3, 5), (5,), 6, 1e-3, torch.float32, "ValueError", id="k>E"),
    pytest.param((3, 5), (4,), 2, 1e-3, torch.float32, "ValueError", id="bias-of-wrong-length"),
    pytest.param((15,), (5,), 2, 1e-3, torch.float32, "ValueError", id="1-D-scores"),
    pytest.param((0, 5), (5,), 2, 1e-3, torch.float32, "ValueError", id="T=0"),
    pytest.param((3, 5), (5,), 2, -1e-3, torch.float32, "ValueError", id="negative-update_rate"),
    pytest.param((3, 5), (5,), 2, float("nan"), torch.float32, "ValueError", id="nan-update_rate"),
    pytest.param((3, 5), (5,), 2, 1e-3, torch.int64, "TypeError", id="int64-scores"),
]


@pytest.mark.parametrize("scores_shape, bias_shape, k, update_rate, scores_dtype, expected_error", INVALID)
def test_invalid_arguments(student, scores_shape, bias_shape, k, update_rate, scores_dtype, expected_error):
    device = current().device
    scores_TE = torch.ones(scores_shape, dtype=scores_dtype, device=device)
    bias_E = torch.zeros(bias_shape, device=device)
    assert_raises(
        student.raises("update_expert_bias", scores_TE, bias_E, k, update_rate), expected_error,
        f"update_expert_bias(scores_TE, expert_bias_E, k={k}, update_rate={update_rate}) for scores_TE of shape "
        f"{scores_shape} and {scores_dtype}, expert_bias_E of shape {bias_shape}",
    )
