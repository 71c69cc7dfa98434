"""Grading moe.router: top-k token-choice routing with its load-balancing and z losses, in plain PyTorch.

Integer outputs (chosen experts, counts) must equal the fast reference's at float32; floating outputs and gradients
are measured against the plain reference in float64 with the reference's own float32 error as the yardstick.
Tokens whose top-(k+1) probabilities are nearly tied are dropped from the random inputs: there, two correct float32
computations may legitimately choose differently. Exact ties are graded separately, on integer logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, given, strategies as st

from assignment.registry import BY_ID
from grader.compare import assert_close, assert_equal
from grader.context import current
from grader.outcomes import WrongAnswer
from grader.profiles import examples
from grader.strategies import LAYOUTS, dims, size_scale

PROBLEM = BY_ID["moe.router"]
FIELDS = ("expert_index_TK", "gate_TK", "tokens_per_expert_E", "balance_loss", "z_loss")
FLOAT32_EPS = torch.finfo(torch.float32).eps
# Logits of adjacent top-(k+1) experts must differ by this many float32 ulps of the token's largest sum_d |x_d w_ed|:
# an order of magnitude above the rounding error of a float32 dot product summed in any order, even sequentially.
TIE_MARGIN_ULPS = 16
WEIGHT_SCALES = (0.25, 1.0, 4.0)  # powers of two: scaling keeps the weights exact in every dtype
LOW_PRECISION = (torch.bfloat16, torch.float16)


def laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as the 2-D tensor `t`, stored with one of the layouts of grader.strategies.LAYOUTS."""
    if layout == "transposed":
        return t.T.contiguous().T
    if layout == "sliced":
        wide = t.new_zeros(t.shape[0], 2 * t.shape[1])
        wide[:, ::2] = t
        return wide[:, ::2]
    if layout == "offset":
        flat = t.new_zeros(t.numel() + 1)
        flat[1:] = t.flatten()
        return flat[1:].view(t.shape)
    return t.contiguous()


def separated_rows(x_TD: torch.Tensor, weight_ED: torch.Tensor, k: int) -> torch.Tensor:
    """Bool [T]: tokens whose k+1 most probable experts are clearly ordered, in float64 and in float32 alike."""
    top = min(k + 1, weight_ED.shape[0])
    logits_TE = x_TD @ weight_ED.T
    sorted_logits_TE = logits_TE.sort(dim=-1, descending=True).values[:, :top]
    margin_T = TIE_MARGIN_ULPS * FLOAT32_EPS * (x_TD.abs() @ weight_ED.abs().T).amax(dim=-1, keepdim=True)
    exact_gaps_ok = (sorted_logits_TE[:, :-1] - sorted_logits_TE[:, 1:] > margin_T).all(dim=-1)
    # Probabilities that underflow to zero in float32 tie there, whatever their logits.
    probs_TE = torch.softmax(x_TD.float() @ weight_ED.float().T, dim=-1)
    sorted_probs_TE = probs_TE.sort(dim=-1, descending=True).values[:, :top]
    float32_distinct = (sorted_probs_TE[:, :-1] > sorted_probs_TE[:, 1:]).all(dim=-1)
    return exact_gaps_ok & float32_distinct


@dataclass(frozen=True)
class RouterCase:
    """One routing problem, built deterministically from its fields: its description is a recipe to reproduce it.

    values: "normal" draws Gaussian x and weight (scaled by weight_scale) and drops nearly tied tokens from twice
    `tokens` candidates; "integers" draws x in [-2, 2] and weight in [-1, 1]; "identity" draws x in [0, 2] with the
    identity as weight (D == E). Integer logits are exact in float32, so their ties are exact.
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
    weight_scale: float = 1.0
    seed: int = 0

    def exact_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x_TD and router_weight_ED in float64, holding exactly the values the student receives."""
        generator = torch.Generator().manual_seed(self.seed)
        if self.values == "normal":
            x_TD = torch.randn(2 * self.tokens, self.width, generator=generator, dtype=torch.float64)
            weight_ED = torch.randn(self.experts, self.width, generator=generator, dtype=torch.float64)
            weight_ED = weight_ED * self.weight_scale
        elif self.values == "integers":
            x_TD = torch.randint(-2, 3, (self.tokens, self.width), generator=generator).double()
            weight_ED = torch.randint(-1, 2, (self.experts, self.width), generator=generator).double()
        else:
            x_TD = torch.randint(0, 3, (self.tokens, self.width), generator=generator).double()
            weight_ED = torch.eye(self.experts, self.width, dtype=torch.float64)
        x_TD = x_TD.to(self.x_dtype).double()
        weight_ED = weight_ED.to(self.weight_dtype).double()
        if self.values == "normal":
            x_TD = x_TD[separated_rows(x_TD, weight_ED, self.k)][: self.tokens]
        return x_TD, weight_ED

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_TD, router_weight_ED) in the case's dtypes, layouts and device; an example with no token is dropped."""
        x_TD, weight_ED = self.exact_inputs()
        assume(x_TD.shape[0] > 0)
        device = current().device
        return (
            laid_out(x_TD.to(self.x_dtype), self.x_layout).to(device),
            laid_out(weight_ED.to(self.weight_dtype), self.weight_layout).to(device),
        )

    def describe(self, x_TD: torch.Tensor) -> str:
        dropped = f", {2 * self.tokens - x_TD.shape[0]} nearly tied tokens dropped" if self.values == "normal" else ""
        scale = f" x {self.weight_scale:g}" if self.values == "normal" else ""
        return (
            f"T={x_TD.shape[0]}, D={self.width}, E={self.experts}, k={self.k}, "
            f"normalize_topk={self.normalize_topk}, values={self.values}{scale}{dropped}, "
            f"x_TD {str(self.x_dtype).removeprefix('torch.')} {self.x_layout}, "
            f"router_weight_ED {str(self.weight_dtype).removeprefix('torch.')} {self.weight_layout}, seed={self.seed}"
        )


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
        weight_scale=draw(st.sampled_from(WEIGHT_SCALES)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def fields(value, context: str) -> dict:
    if not isinstance(value, tuple) or len(value) != len(FIELDS):
        raise WrongAnswer(f"topk_route must return a RouterOutput of {len(FIELDS)} fields, got {value!r:.200} ({context})")
    return dict(zip(FIELDS, value))


class Routing:
    """The student's routing of one case, with the fast reference at the same dtypes and the plain one in float64."""

    def __init__(self, student, reference, case: RouterCase, grad_upstream: bool = False):
        self.case = case
        self.x_TD, self.weight_ED = case.inputs()
        self.context = case.describe(self.x_TD)
        arguments = (case.k, case.normalize_topk)
        self.upstream = self.draw_upstream() if grad_upstream else None
        with student.describing(self.context):
            if self.upstream is None:
                self.actual = fields(student.call("topk_route", self.x_TD, self.weight_ED, *arguments), self.context)
            else:
                reply = student.call_traced(
                    "topk_route", self.x_TD, self.weight_ED, *arguments,
                    grad={"inputs": [0, 1], "upstream": [u.float() if u is not None else None for u in self.upstream]},
                )
                self.actual = fields(reply["value"], self.context)
                self.actual_grads = reply["grads"]
        self.at_dtype = dict(zip(FIELDS, reference.topk_route(self.x_TD, self.weight_ED, *arguments)))
        self.exact = dict(zip(FIELDS, reference.topk_route_torch(self.x_TD.double(), self.weight_ED.double(),
                                                                   *arguments)))
        self.reference = reference

    def draw_upstream(self) -> list:
        """Upstream gradients for (gate_TK, balance_loss, z_loss), float32 values held in float64."""
        generator = torch.Generator().manual_seed(self.case.seed + 1)
        gate_TK = torch.randn(self.x_TD.shape[0], self.case.k, generator=generator, dtype=torch.float64)
        balance, z = torch.randn(2, generator=generator, dtype=torch.float64)
        device = current().device
        return [None, gate_TK.float().double().to(device), None, balance.float().double().to(device),
                z.float().double().to(device)]

    def check_equal(self, name: str) -> None:
        assert_equal(self.actual[name], self.at_dtype[name], what=name, context=self.context)

    def check_close(self, name: str) -> None:
        assert_close(self.actual[name], self.exact[name], self.at_dtype[name], what=name, context=self.context,
                     multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps)

    def check_gradients(self) -> None:
        exact = self.reference_grads(self.reference.topk_route_torch, torch.float64)
        at_dtype = self.reference_grads(self.reference.topk_route, None)
        for name, actual, expected64, expected_at_dtype in zip(
            ("x_TD", "router_weight_ED"), self.actual_grads, exact, at_dtype
        ):
            if actual is None:
                raise WrongAnswer(f"{name} received no gradient from gate_TK, balance_loss and z_loss ({self.context})")
            assert_close(actual, expected64, expected_at_dtype, what=f"gradient of {name}", context=self.context,
                         multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps)

    def reference_grads(self, route, dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients of (x_TD, router_weight_ED) through `route` on the inputs in `dtype` (None: their own)."""
        x_TD = self.x_TD.detach().to(dtype or self.x_TD.dtype).requires_grad_(True)
        weight_ED = self.weight_ED.detach().to(dtype or self.weight_ED.dtype).requires_grad_(True)
        outputs = route(x_TD, weight_ED, self.case.k, self.case.normalize_topk)
        output_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        pairs = [(out, up.to(output_dtype)) for out, up in zip(outputs, self.upstream) if up is not None]
        torch.autograd.backward([out for out, _ in pairs], [up for _, up in pairs])
        return x_TD.grad, weight_ED.grad


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
    routing = Routing(student, reference, case, grad_upstream=True)
    routing.check_gradients()


low_precision_dtypes = st.tuples(
    st.sampled_from(LOW_PRECISION), st.sampled_from((*LOW_PRECISION, torch.float32))
).flatmap(lambda pair: st.sampled_from((pair, pair[::-1])))


@examples(PROBLEM)
@given(case=router_cases(dtypes=low_precision_dtypes))
def test_low_precision_inputs(student, reference, case):
    """bfloat16 and float16 inputs: the outputs are float32, computed from inputs cast to float32, and the gradients
    arrive in each input's dtype."""
    routing = Routing(student, reference, case, grad_upstream=True)
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
    raised = student.raises("topk_route", x_TD, weight_ED, k, True)
    if raised is None or expected_error not in raised.type_names:
        got = f"it raised {raised.raised}" if raised else "it returned normally"
        raise WrongAnswer(
            f"topk_route(x_TD, router_weight_ED, k={k}) for x_TD of shape {x_shape} and {x_dtype}, router_weight_ED "
            f"of shape {weight_shape} and {weight_dtype} must raise {expected_error}; {got}"
        )
