"""Grading moe.upcycle: a dense SwiGLU MLP turned into an MoE layer whose experts are copies of it.

Everything upcycling produces is pinned exactly: the experts are bit-for-bit copies, the router is a stated draw
from a seeded generator. Independence of the copies is checked inside the student's worker by updating one in
place. The layer's equivalence with the dense MLP is checked in float64, where it holds to float64 rounding: the
weights are exact in float64, every expert output of a token is the same dense output (up to the order in which a
matmul sums), and renormalised gates sum to 1, so the MoE output is the dense output up to about 1e-16 relative.
A float32 evaluation could not be judged so tightly: a matmul may round one row differently depending on how many
rows it is given, so the k expert outputs of a token need not be bitwise equal there. Every upcycling error (a
wrong copy, gates that do not sum to 1, a scale) moves the output by far more than the 1e-9 allowed.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_equal, assert_raises, check_tensor_form
from grader.checks.outcomes import WrongAnswer
from grader.checks.profiles import examples
from grader.checks.strategies import dims, size_scale
from grader.moe.routing_checks import dtype_name, returned_fields
from grader.session.context import current

PROBLEM = BY_ID["moe.upcycle"]
FIELDS = ("router_weight_ED", "gate_proj_EHD", "up_proj_EHD", "down_proj_EDH", "normalize_topk")
EXPERT_FIELDS = {"gate_proj_EHD": 0, "up_proj_EHD": 1, "down_proj_EDH": 2}  # and the dense weight each copies
DENSE = ("gate_proj_HD", "up_proj_HD", "down_proj_DH")
# Dense weights are copied, not computed with, so every dtype is graded on every device.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROUTER_STDS = (0.0, 0.02, 1.0)
# The MoE output may differ from the dense output by this much relative to the output's terms (see the docstring).
EQUIVALENCE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class UpcycleCase:
    """A dense MLP of Gaussian weights (scaled by 1 / sqrt(fan-in)), upcycled with the given arguments."""

    width: int
    hidden: int
    experts: int
    router_std: float
    router_seed: int
    dtype: torch.dtype = torch.float32
    transposed: bool = False
    seed: int = 0

    def dense(self) -> list[torch.Tensor]:
        """gate_proj_HD, up_proj_HD, down_proj_DH; with `transposed`, transposed views of contiguous tensors."""
        generator = torch.Generator().manual_seed(self.seed)
        shapes = ((self.hidden, self.width), (self.hidden, self.width), (self.width, self.hidden))
        device = current().device
        weights = []
        for rows, cols in shapes:
            stored = (cols, rows) if self.transposed else (rows, cols)
            weight = torch.randn(stored, generator=generator, dtype=torch.float64) * cols**-0.5
            weight = weight.to(self.dtype).to(device)
            weights.append(weight.T if self.transposed else weight)
        return weights

    def arguments(self) -> tuple:
        return (*self.dense(), self.experts, self.router_std, self.router_seed)

    def describe(self) -> str:
        layout = "transposed views" if self.transposed else "contiguous"
        return (f"D={self.width}, H={self.hidden}, E={self.experts}, router_std={self.router_std:g}, "
                f"seed={self.router_seed}; dense weights {dtype_name(self.dtype)}, {layout}, drawn from seed "
                f"{self.seed}")


@st.composite
def upcycle_cases(draw) -> UpcycleCase:
    return UpcycleCase(
        width=draw(dims(32 * size_scale())),
        hidden=draw(dims(24 * size_scale())),
        experts=draw(dims(16, tiles=(8, 16))),
        router_std=draw(st.sampled_from(ROUTER_STDS)),
        router_seed=draw(st.integers(0, 2**63 - 1)),
        dtype=draw(st.sampled_from(DTYPES)),
        transposed=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def upcycled(student, case: UpcycleCase) -> dict:
    with student.describing(case.describe()):
        value = student.call("upcycle", *case.arguments())
    return returned_fields(value, FIELDS, "upcycle", case.describe())


@examples(PROBLEM)
@given(case=upcycle_cases())
def test_expert_copies(student, reference, case):
    """Every expert's three projections equal the dense ones bit for bit, in their dtype and on their device."""
    actual = upcycled(student, case)
    expected = reference.upcycle(*case.arguments())._asdict()
    for name in EXPERT_FIELDS:
        assert_equal(actual[name], expected[name], what=name, context=case.describe())


@examples(PROBLEM)
@given(case=upcycle_cases())
def test_router_init(student, reference, case):
    """The router is exactly the pinned draw: randn(E, D) from a CPU generator seeded with `seed`, times router_std."""
    actual = upcycled(student, case)
    expected = reference.upcycle(*case.arguments()).router_weight_ED
    assert_equal(actual["router_weight_ED"], expected, what="router_weight_ED", context=case.describe())


def independence_problems(module, gate_proj_HD, up_proj_HD, down_proj_DH, experts: int, router_std: float,
                          seed: int) -> list[str]:
    """Run in the student's worker: what an in-place update of one expert, or of a dense weight, also changed."""
    problems = []
    dense = (gate_proj_HD, up_proj_HD, down_proj_DH)
    for name, source in EXPERT_FIELDS.items():
        fresh = [weight.clone() for weight in dense]
        copies = module.upcycle(*fresh, experts, router_std, seed)[source + 1]
        before = copies.clone()
        try:
            with torch.no_grad():
                copies[0].add_(1.0)
        except RuntimeError as error:
            problems.append(f"adding 1 to {name}[0] in place raised {error}")
            continue
        changed = [e for e in range(1, experts) if not torch.equal(copies[e], before[e])]
        if changed:
            problems.append(f"adding 1 to {name}[0] in place also changed expert(s) {changed[:8]}: the experts "
                            f"share memory")
        if not torch.equal(fresh[source], dense[source]):
            problems.append(f"adding 1 to {name}[0] in place also changed the dense {DENSE[source]}")
        fresh = [weight.clone() for weight in dense]
        copies = module.upcycle(*fresh, experts, router_std, seed)[source + 1]
        before = copies.clone()
        with torch.no_grad():
            fresh[source].add_(1.0)
        if not torch.equal(copies, before):
            problems.append(f"adding 1 to the dense {DENSE[source]} after upcycling changed {name}")
    return problems


@examples(PROBLEM, 0.5)
@given(case=upcycle_cases())
def test_experts_independent(student, reference, case):
    """Each expert owns its weights: updating one expert, or the dense MLP, in place changes nothing else."""
    with student.describing(case.describe()):
        problems = student.run_program(f"{__name__}:independence_problems", *case.arguments())
    if problems:
        raise WrongAnswer(f"the experts are not independent copies: {'; '.join(problems)} ({case.describe()})")


def dense_mlp(x_TD, gate_proj_HD, up_proj_HD, down_proj_DH) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x_TD, gate_proj_HD)) * F.linear(x_TD, up_proj_HD), down_proj_DH)


def routed_mlp(x_TD, router_weight_ED, gate_proj_EHD, up_proj_EHD, down_proj_EDH, k: int,
               normalize_topk: bool) -> torch.Tensor:
    """The MoE layer (no shared expert) as moe.moe_layer specifies it, evaluated the plain way in x's dtype: every
    expert on every token, then each token's k chosen outputs weighed by their gates. Its E / k times the needed
    work is no concern for an oracle, and it keeps this test independent of the student's moe_layer."""
    probs_TE = torch.softmax(x_TD @ router_weight_ED.T, dim=-1)
    expert_TK = torch.sort(probs_TE, dim=-1, descending=True, stable=True).indices[:, :k]  # ties: lower index
    gate_TK = probs_TE.gather(1, expert_TK)
    if normalize_topk:
        gate_TK = gate_TK / gate_TK.sum(dim=-1, keepdim=True)
    every_TED = torch.stack([dense_mlp(x_TD, *weights) for weights in zip(gate_proj_EHD, up_proj_EHD, down_proj_EDH)],
                            dim=1)
    chosen_TKD = every_TED.gather(1, expert_TK[:, :, None].expand(-1, -1, x_TD.shape[1]))
    return (gate_TK[:, :, None] * chosen_TKD).sum(dim=1)


@examples(PROBLEM)
@given(case=upcycle_cases(), tokens=dims(48), k_fraction=st.floats(0, 1))
def test_matches_dense(student, reference, case, tokens, k_fraction):
    """The upcycled layer (the MoE layer of moe.moe_layer's contract, run with the returned normalize_topk, no
    shared expert) gives the dense MLP's output for every k, in float64."""
    actual = upcycled(student, case)
    k = 1 + round(k_fraction * (case.experts - 1))
    context = f"{case.describe()}; T={tokens}, k={k}, x standard normal"
    if not isinstance(actual["normalize_topk"], bool):
        raise WrongAnswer(f"normalize_topk must be a bool, got {actual['normalize_topk']!r} ({context})")
    forms = reference.upcycle(*case.arguments())._asdict()
    for name in FIELDS[:-1]:
        check_tensor_form(actual[name], forms[name], name, context)
    dense = [weight.double().cpu() for weight in case.dense()]
    generator = torch.Generator().manual_seed(case.seed + 1)
    x_TD = torch.randn(tokens, case.width, generator=generator, dtype=torch.float64)
    expected = dense_mlp(x_TD, *dense)
    router_ED, *expert_weights = (actual[name].double().cpu() for name in FIELDS[:-1])
    y_TD = routed_mlp(x_TD, router_ED, *expert_weights, k, actual["normalize_topk"])
    # The terms of the output: no float64 evaluation can be closer than a few ulps of these.
    term_scale = float(dense_mlp(x_TD.abs(), *(w.abs() for w in dense)).max())
    error = float((y_TD - expected).abs().max())
    allowed = EQUIVALENCE_TOLERANCE * term_scale
    if not error <= allowed:
        worst = int((y_TD - expected).abs().flatten().argmax())
        raise WrongAnswer(
            f"the upcycled layer's output differs from the dense MLP's by {error:.3g} (allowed {allowed:.3g}), e.g. "
            f"{float(y_TD.flatten()[worst]):.6g} instead of {float(expected.flatten()[worst]):.6g}, with "
            f"normalize_topk={actual['normalize_topk']} ({context})"
        )


def _weights(gate=(3, 4), up=(3, 4), down=(4, 3), dtype=torch.float32, down_dtype=None):
    return lambda device: [torch.ones(gate, dtype=dtype, device=device), torch.ones(up, dtype=dtype, device=device),
                           torch.ones(down, dtype=down_dtype or dtype, device=device)]


INVALID = [
    pytest.param(_weights(), 0, 0.02, 0, "ValueError", id="no-experts"),
    pytest.param(_weights(), 4, -0.02, 0, "ValueError", id="negative-std"),
    pytest.param(_weights(), 4, float("nan"), 0, "ValueError", id="nan-std"),
    pytest.param(_weights(), 4, 0.02, -1, "ValueError", id="negative-seed"),
    pytest.param(_weights(), 4, 0.02, 2**63, "ValueError", id="seed-2**63"),
    pytest.param(_weights(down=(3, 4)), 4, 0.02, 0, "ValueError", id="down-not-DH"),
    pytest.param(_weights(up=(3, 5)), 4, 0.02, 0, "ValueError", id="up-mismatch"),
    pytest.param(_weights(gate=(12,)), 4, 0.02, 0, "ValueError", id="1-D-gate"),
    pytest.param(_weights(dtype=torch.int32), 4, 0.02, 0, "TypeError", id="int32"),
    pytest.param(_weights(down_dtype=torch.float64), 4, 0.02, 0, "TypeError", id="dtype-mismatch"),
]


@pytest.mark.parametrize("make, experts, router_std, seed, expected_error", INVALID)
def test_invalid_arguments(student, make, experts, router_std, seed, expected_error):
    weights = make(current().device)
    shapes = ", ".join(f"{name} {tuple(w.shape)} {dtype_name(w.dtype)}" for name, w in zip(DENSE, weights))
    assert_raises(student.raises("upcycle", *weights, experts, router_std, seed), expected_error,
                  f"upcycle({shapes}, num_experts={experts}, router_std={router_std}, seed={seed})")
