"""Grading moe.capacity: expert capacity and token dropping for token-choice top-k routing, in plain PyTorch.

Every output is discrete or an exact copy of input values, so everything is compared exactly with the reference:
the capacity, the kept set, the buffer positions, the gates (the input gates or exactly 0) and their gradient.
Routings are drawn with a skewed expert popularity so that popular experts overflow and others stay empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_equal, assert_raises
from grader.checks.outcomes import WrongAnswer
from grader.checks.profiles import examples
from grader.checks.strategies import dims, size_scale
from grader.moe.routing_checks import dtype_name, returned_fields
from grader.session.context import current

PROBLEM = BY_ID["moe.capacity"]
FIELDS = ("capacity", "kept_TK", "position_TK", "gate_TK", "tokens_per_expert_E")
# Multiples of 1/4: capacity_factor * T * k / E is then computed exactly enough that its ceiling is unambiguous.
CAPACITY_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 4.0)
# Standard deviation of the experts' popularity logits: uniform routing up to a few experts taking most tokens.
SKEWS = (0.0, 1.0, 3.0)
GATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class CapacityCase:
    """One routing to apply a capacity to, built deterministically from its fields (its description reproduces it).

    Token t picks its k experts by the Gumbel top-k trick over popularity_E (Gaussian with standard deviation
    `skew`, the same for every token): the k distinct experts of largest popularity_E + Gumbel noise, first choice
    first. Its gates are a softmax of Gaussian scores over its k slots. With `transposed`, both inputs are
    transposed views of [k, T] tensors.
    """

    tokens: int
    experts: int
    k: int
    capacity_factor: float
    skew: float = 1.0
    gate_dtype: torch.dtype = torch.float32
    transposed: bool = False
    seed: int = 0

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        popularity_E = torch.randn(self.experts, generator=generator, dtype=torch.float64) * self.skew
        uniform_TE = torch.rand(self.tokens, self.experts, generator=generator, dtype=torch.float64)
        gumbel_TE = -torch.log(-torch.log(uniform_TE.clamp(1e-12, 1 - 1e-12)))
        expert_index_TK = (popularity_E + gumbel_TE).topk(self.k, dim=1).indices
        scores_TK = torch.randn(self.tokens, self.k, generator=generator, dtype=torch.float64)
        gate_TK = torch.softmax(scores_TK, dim=1).to(self.gate_dtype)
        if self.transposed:
            expert_index_TK, gate_TK = expert_index_TK.T.contiguous().T, gate_TK.T.contiguous().T
        device = current().device
        return expert_index_TK.to(device), gate_TK.to(device)

    def arguments(self) -> tuple:
        return (*self.inputs(), self.experts, self.capacity_factor)

    def describe(self) -> str:
        layout = "transposed" if self.transposed else "contiguous"
        return (
            f"T={self.tokens}, E={self.experts}, k={self.k}, capacity_factor={self.capacity_factor:g}, "
            f"expert popularity skew={self.skew:g}, gate_TK {dtype_name(self.gate_dtype)}, "
            f"inputs {layout}, seed={self.seed}"
        )


@st.composite
def capacity_cases(draw, gate_dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> CapacityCase:
    experts = draw(dims(32 * size_scale(), tiles=(8, 16, 32, 64)))
    return CapacityCase(
        tokens=draw(dims(64 * size_scale())),
        experts=experts,
        k=draw(st.integers(1, min(experts, 8))),
        capacity_factor=draw(st.sampled_from(CAPACITY_FACTORS)),
        skew=draw(st.sampled_from(SKEWS)),
        gate_dtype=draw(st.sampled_from(gate_dtypes)),
        transposed=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


class Dropping:
    """The student's and the reference's outputs on one case, by field name."""

    def __init__(self, student, reference, case: CapacityCase):
        self.student, self.reference, self.case = student, reference, case
        self.arguments = case.arguments()
        self.context = case.describe()
        with student.describing(self.context):
            value = student.call("apply_capacity", *self.arguments)
        self.actual = returned_fields(value, FIELDS, "apply_capacity", self.context, "a CapacityOutput")
        with torch.no_grad():
            self.expected = dict(zip(FIELDS, reference.apply_capacity(*self.arguments)))

    def check_capacity(self) -> None:
        actual, expected = self.actual["capacity"], self.expected["capacity"]
        if type(actual) is not int:
            raise WrongAnswer(f"capacity: expected a Python int, got {type(actual).__name__} {actual!r:.80} "
                              f"({self.context})")
        if actual != expected:
            case = self.case
            raise WrongAnswer(
                f"capacity: got {actual}, expected {expected} = ceil({case.capacity_factor:g} x T={case.tokens} x "
                f"k={case.k} / E={case.experts}) ({self.context})"
            )

    def check_equal(self, name: str) -> None:
        assert_equal(self.actual[name], self.expected[name], what=name, context=self.context)

    def check_gate_gradient(self) -> None:
        """The gradient reaching the input gates: the upstream gradient where kept and 0 where dropped, exactly."""
        expert_index_TK, gate_TK = self.arguments[:2]
        generator = torch.Generator().manual_seed(self.case.seed + 1)
        upstream_TK = torch.randn(gate_TK.shape, generator=generator).to(gate_TK.dtype).to(gate_TK.device)
        grad = {"inputs": [1], "upstream": [None, None, None, upstream_TK, None]}
        with self.student.describing(self.context):
            actual = self.student.call_traced("apply_capacity", *self.arguments, grad=grad)["grads"][0]
        what = "gradient of gate_TK (input) from gate_TK (output)"
        if actual is None:
            raise WrongAnswer(f"{what}: the input gate_TK received no gradient ({self.context})")
        gate_TK = gate_TK.detach().requires_grad_(True)
        output = self.reference.apply_capacity(expert_index_TK, gate_TK, *self.arguments[2:])
        output.gate_TK.backward(upstream_TK)
        assert_equal(actual, gate_TK.grad, what=what, context=self.context)


# ceil(4 x 3 x 2 / 4) = 6 slots for 3 tokens: the contract says the capacity is not capped at T.
CAPACITY_ABOVE_T = CapacityCase(tokens=3, experts=4, k=2, capacity_factor=4.0, seed=1)


@examples(PROBLEM, 0.5)
@given(case=capacity_cases())
@example(case=CAPACITY_ABOVE_T)
def test_capacity(student, reference, case):
    Dropping(student, reference, case).check_capacity()


@examples(PROBLEM)
@given(case=capacity_cases())
def test_kept_set(student, reference, case):
    dropping = Dropping(student, reference, case)
    dropping.check_capacity()
    dropping.check_equal("kept_TK")
    dropping.check_equal("tokens_per_expert_E")


@examples(PROBLEM)
@given(case=capacity_cases())
def test_positions(student, reference, case):
    dropping = Dropping(student, reference, case)
    dropping.check_capacity()
    dropping.check_equal("position_TK")


@examples(PROBLEM)
@given(case=capacity_cases(gate_dtypes=GATE_DTYPES))
def test_gates(student, reference, case):
    dropping = Dropping(student, reference, case)
    dropping.check_equal("gate_TK")
    dropping.check_gate_gradient()


def invalid(expert_rows, gate_dtype=torch.float32, num_experts=4, capacity_factor=1.0, error="ValueError",
            index_dtype=torch.int64, gate_shape=None, id=None):
    return pytest.param(expert_rows, index_dtype, gate_dtype, gate_shape, num_experts, capacity_factor, error, id=id)


INVALID = [
    invalid([[0, 1], [2, 3]], capacity_factor=0.0, id="capacity_factor=0"),
    invalid([[0, 1], [2, 3]], capacity_factor=-1.0, id="capacity_factor<0"),
    invalid([[0, 1], [2, 3]], num_experts=0, id="E=0"),
    invalid([[0, 1], [2, 4]], id="index>=E"),
    invalid([[0, 1], [-1, 3]], id="index<0"),
    invalid([[0, 1], [2, 2]], id="expert-twice"),
    invalid([[0, 1], [2, 3]], gate_shape=(2, 3), id="shape-mismatch"),
    invalid([0, 1, 2], gate_shape=(3,), id="1-D"),
    invalid([[], []], gate_shape=(2, 0), id="k=0"),
    invalid([[0, 1], [2, 3]], index_dtype=torch.int32, error="TypeError", id="int32-indices"),
    invalid([[0, 1], [2, 3]], gate_dtype=torch.int64, error="TypeError", id="int64-gates"),
]


@pytest.mark.parametrize(
    "expert_rows, index_dtype, gate_dtype, gate_shape, num_experts, capacity_factor, expected_error", INVALID
)
def test_invalid_arguments(student, expert_rows, index_dtype, gate_dtype, gate_shape, num_experts, capacity_factor,
                           expected_error):
    device = current().device
    expert_index_TK = torch.tensor(expert_rows, dtype=index_dtype, device=device)
    gate_TK = torch.ones(gate_shape or expert_index_TK.shape, dtype=gate_dtype, device=device)
    assert_raises(
        student.raises("apply_capacity", expert_index_TK, gate_TK, num_experts, capacity_factor), expected_error,
        f"apply_capacity(expert_index_TK={expert_rows} ({index_dtype}), gate_TK of shape {tuple(gate_TK.shape)} "
        f"and {gate_dtype}, num_experts={num_experts}, capacity_factor={capacity_factor})",
    )
