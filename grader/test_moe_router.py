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
from grader.compare import assert_close, assert_equal, check_tensor_form
from grader.context import current
from grader.outcomes import WrongAnswer
from grader.profiles import examples
from grader.strategies import LAYOUTS, dims, size_scale

PROBLEM = BY_ID["moe.router"]
FIELDS = ("expert_index_TK", "gate_TK", "tokens_per_expert_E", "balance_loss", "z_loss")
DIFFERENTIABLE = ("gate_TK", "balance_loss", "z_loss")
FLOAT32_EPS = torch.finfo(torch.float32).eps
# Logits of adjacent top-(k+1) experts must differ by this many float32 ulps of the token's largest sum_d |x_d w_ed|
# plus |log p| (see separated_rows): several times the rounding error of any reasonable float32 computation.
TIE_MARGIN_ULPS = 16
# Standard deviations of the logits of Gaussian inputs: nearly uniform routing up to nearly one-hot routing.
LOGIT_SCALES = (0.25, 1.0, 4.0, 16.0)
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
    # Rounding moves a float32 logit by a few ulps of sum_d |x_d w_ed|, and a float32 probability by a few ulps of
    # itself times |log p| (computed as exp(l - logsumexp(l)), say).
    abs_dot_T = (x_TD.abs() @ weight_ED.abs().T).amax(dim=-1, keepdim=True)
    smallest_log_prob_T = sorted_logits_TE[:, -1:] - torch.logsumexp(logits_TE, dim=-1, keepdim=True)
    margin_T = TIE_MARGIN_ULPS * FLOAT32_EPS * (abs_dot_T - smallest_log_prob_T)
    exact_gaps_ok = (sorted_logits_TE[:, :-1] - sorted_logits_TE[:, 1:] > margin_T).all(dim=-1)
    # Below the normal range float32 probabilities lose precision until they all tie at zero, differently for each
    # way of computing them: the k chosen ones must be normal numbers.
    probs_TE = torch.softmax(x_TD.float() @ weight_ED.float().T, dim=-1)
    kth_prob_T = probs_TE.topk(k, dim=-1).values[:, -1]
    return exact_gaps_ok & (kth_prob_T >= torch.finfo(torch.float32).tiny)


@dataclass(frozen=True)
class RouterCase:
    """One routing problem, built deterministically from its fields: its description is a recipe to reproduce it.

    values: "normal" draws Gaussian x and weight, the weight scaled so that the logits' standard deviation is
    logit_scale, and keeps the first `tokens` of twice as many drawn tokens that are not nearly tied; "integers" draws x in [-2, 2] and weight in [-1, 1]; "identity" draws x in [0, 2] with the
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
    logit_scale: float = 1.0
    seed: int = 0

    def exact_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x_TD and router_weight_ED in float64, holding exactly the values the student receives."""
        generator = torch.Generator().manual_seed(self.seed)
        if self.values == "normal":
            x_TD = torch.randn(2 * self.tokens, self.width, generator=generator, dtype=torch.float64)
            weight_ED = torch.randn(self.experts, self.width, generator=generator, dtype=torch.float64)
            weight_ED = weight_ED * (self.logit_scale / self.width**0.5)
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
        values = self.values
        if values == "normal":
            values = f"normal with logit scale {self.logit_scale:g}, of {2 * self.tokens} tokens those not nearly tied"
        return (
            f"T={x_TD.shape[0]}, D={self.width}, E={self.experts}, k={self.k}, normalize_topk={self.normalize_topk}, "
            f"values={values}, x_TD {str(self.x_dtype).removeprefix('torch.')} {self.x_layout}, "
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
        logit_scale=draw(st.sampled_from(LOGIT_SCALES)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def fields(value, context: str) -> dict:
    if not isinstance(value, tuple) or len(value) != len(FIELDS):
        raise WrongAnswer(f"topk_route must return a RouterOutput of {len(FIELDS)} fields, got {value!r:.200} ({context})")
    return dict(zip(FIELDS, value))


def nudged(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32, every nonzero value moved one ulp away from zero: inputs as near as rounding could leave."""
    t = t.float()
    return torch.nextafter(t, 2 * t)


def farther(exact: torch.Tensor, *candidates: torch.Tensor) -> torch.Tensor:
    """The candidate farthest from `exact`: the larger of the reference's float32 errors sets the tolerance."""
    return max(candidates, key=lambda c: float((c.detach().double() - exact.double()).abs().max()))


def reference_gradients(route, x_TD, weight_ED, case: RouterCase, field: str, upstream: torch.Tensor):
    """Gradients of (x_TD, weight_ED) when `field` of route(...) receives `upstream`."""
    x_TD = x_TD.detach().requires_grad_(True)
    weight_ED = weight_ED.detach().requires_grad_(True)
    output = dict(zip(FIELDS, route(x_TD, weight_ED, case.k, case.normalize_topk)))[field]
    output.backward(upstream.to(output.dtype))
    return x_TD.grad, weight_ED.grad


def z_loss_term_scale(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> float:
    """The z loss's sensitivity to the rounding of the logits: mean over tokens of 2 |lse_t| max_e sum_d |x_d w_ed|.

    A float32 logit is only as exact as its largest terms allow, so where a token's logits nearly cancel (lse_t
    near zero) the loss's own magnitude understates the error of any float32 computation.
    """
    x_TD, weight_ED = x_TD.double().cpu(), weight_ED.double().cpu()
    lse_T = torch.logsumexp(x_TD @ weight_ED.T, dim=-1)
    return float((2 * lse_T.abs() * (x_TD.abs() @ weight_ED.abs().T).amax(dim=-1)).mean())


class Routing:
    """The student's routing of one case, and the reference's: the fast one at the case's dtypes (whose integer
    outputs must be matched exactly), the fast one on nudged float32 inputs, and the plain one in float64.

    A float32 computation is as good as the reference's when it is as near the float64 value as the reference is
    on inputs rounded either way, so the farther of the two float32 runs calibrates each tolerance: without it, a
    correct computation that is more sensitive to the rounding of the logits could fail where the reference is
    lucky. Nudging cannot change a choice: near ties were dropped.
    """

    def __init__(self, student, reference, case: RouterCase):
        self.student, self.reference, self.case = student, reference, case
        self.x_TD, self.weight_ED = case.inputs()
        self.context = case.describe(self.x_TD)
        arguments = (case.k, case.normalize_topk)
        with student.describing(self.context):
            self.actual = fields(student.call("topk_route", self.x_TD, self.weight_ED, *arguments), self.context)
        with torch.no_grad():
            self.at_dtype = dict(zip(FIELDS, reference.topk_route(self.x_TD, self.weight_ED, *arguments)))
            self.nudged = dict(zip(FIELDS, reference.topk_route(nudged(self.x_TD), nudged(self.weight_ED), *arguments)))
            self.exact = dict(zip(FIELDS, reference.topk_route_torch(self.x_TD.double(), self.weight_ED.double(),
                                                                      *arguments)))

    def check_equal(self, name: str) -> None:
        assert_equal(self.actual[name], self.at_dtype[name], what=name, context=self.context)

    def check_close(self, name: str) -> None:
        expected = self.exact[name]
        floor_ulps = PROBLEM.floor_ulps
        if name == "z_loss":
            floor_ulps *= max(1.0, z_loss_term_scale(self.x_TD, self.weight_ED) / float(expected.abs()))
        assert_close(self.actual[name], expected, farther(expected, self.at_dtype[name], self.nudged[name]),
                     what=name, context=self.context, multiple=PROBLEM.error_multiple, floor_ulps=floor_ulps)

    def check_gradients(self) -> None:
        """Backpropagate a random upstream gradient from each differentiable output in turn: a gradient too small to
        notice beside the others' still has to be right."""
        generator = torch.Generator().manual_seed(self.case.seed + 1)
        device = current().device
        for field in DIFFERENTIABLE:
            shape = self.exact[field].shape
            upstream = torch.randn(shape, generator=generator, dtype=torch.float64).float().to(device)
            self.check_gradients_from(field, upstream)

    def check_gradients_from(self, field: str, upstream: torch.Tensor) -> None:
        grad = {"inputs": [0, 1], "upstream": [upstream if name == field else None for name in FIELDS]}
        with self.student.describing(self.context):
            actual = self.student.call_traced(
                "topk_route", self.x_TD, self.weight_ED, self.case.k, self.case.normalize_topk, grad=grad
            )["grads"]
        route, route_torch = self.reference.topk_route, self.reference.topk_route_torch
        exact = reference_gradients(route_torch, self.x_TD.double(), self.weight_ED.double(), self.case, field,
                                    upstream)
        at_dtype = reference_gradients(route, self.x_TD, self.weight_ED, self.case, field, upstream)
        from_nudged = reference_gradients(route, nudged(self.x_TD), nudged(self.weight_ED), self.case, field, upstream)
        term_scales = backward_term_scales(self.x_TD, self.weight_ED, self.exact, field, upstream)
        for index, name in enumerate(("x_TD", "router_weight_ED")):
            what = f"gradient of {name} from {field}"
            if actual[index] is None:
                raise WrongAnswer(f"{what}: {name} received no gradient ({self.context})")
            dtype = (self.x_TD, self.weight_ED)[index].dtype
            expected_at_dtype = farther(exact[index], at_dtype[index], from_nudged[index].to(dtype))
            check_gradient(actual[index], exact[index], expected_at_dtype, term_scales[index], what, self.context)


def backward_term_scales(x_TD, weight_ED, exact: dict, field: str, upstream: torch.Tensor) -> tuple[float, float]:
    """How large the terms are that a backward pass from `field` sums into the gradients of x_TD and weight_ED.

    Every way of computing the gradient sums, per token t, terms of about probs_TE[t, e] times G_t, the size of the
    upstream gradient reaching that token's probabilities, so about G_t in all; and a softmax written out with the
    row maximum subtracted routes all of them through one logit. Where the terms cancel (the balance loss of one
    token whose k experts hold nearly all the probability, say) float32 cannot resolve the difference, so the
    error floor scales with the terms rather than with the result.
    """
    x_TD, weight_ED = x_TD.double().cpu(), weight_ED.double().cpu()
    upstream = upstream.double().cpu()
    num_tokens, num_experts = x_TD.shape[0], weight_ED.shape[0]
    logits_TE = x_TD @ weight_ED.T
    if field == "gate_TK":
        per_token_T = upstream.abs().sum(dim=-1)
        if exact["gate_TK"].shape[1] < num_experts and bool((exact["gate_TK"].sum(dim=-1) - 1).abs().max() < 1e-9):
            # Renormalised gates divide by the chosen probabilities' sum.
            probs_TE = torch.softmax(logits_TE, dim=-1)
            per_token_T = per_token_T / probs_TE.gather(1, exact["expert_index_TK"].cpu()).sum(dim=-1)
    elif field == "balance_loss":
        slot_fraction_E = exact["tokens_per_expert_E"].cpu().double() / exact["expert_index_TK"].numel()
        per_token_T = (upstream.abs() * num_experts * slot_fraction_E.max() / num_tokens).expand(num_tokens)
    else:
        # d z_loss / d logits_TE = 2 lse_t probs_TE / T, and lse_t itself is only as exact as the logits' terms.
        lse_T = torch.logsumexp(logits_TE, dim=-1).abs() + (x_TD.abs() @ weight_ED.abs().T).amax(dim=-1)
        per_token_T = upstream.abs() * 2 * lse_T / num_tokens
    return (
        float((per_token_T[:, None] * weight_ED.abs().amax(dim=0)).max()),
        float((per_token_T @ x_TD.abs()).max()),
    )


def check_gradient(actual, exact, expected_at_dtype, term_scale: float, what: str, context: str) -> None:
    """assert_close, with its error floor set by the scale of the backward's terms when that exceeds the result's."""
    result_scale = float(exact.abs().max())
    if result_scale > 0:
        assert_close(actual, exact, expected_at_dtype, what=what, context=context, multiple=PROBLEM.error_multiple,
                     floor_ulps=PROBLEM.floor_ulps * max(1.0, term_scale / result_scale))
        return
    # The output is constant here (renormalised gates with k = 1; the balance loss with k = E, where every f_i is
    # 1/E and sum_i P_i = 1): the gradient is zero, up to rounding in the terms that cancel.
    check_tensor_form(actual, expected_at_dtype, what, context)
    largest = float(actual.detach().abs().max()) if actual.numel() else 0.0
    allowed = PROBLEM.floor_ulps * torch.finfo(expected_at_dtype.dtype).eps * term_scale
    if largest > allowed:
        raise WrongAnswer(f"{what}: expected zero (the output is constant here), got values up to {largest:.3g}; "
                          f"allowed {allowed:.3g} ({context})")


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


low_precision_dtypes = st.tuples(
    st.sampled_from(LOW_PRECISION), st.sampled_from((*LOW_PRECISION, torch.float32))
).flatmap(lambda pair: st.sampled_from((pair, pair[::-1])))


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
    raised = student.raises("topk_route", x_TD, weight_ED, k, True)
    if raised is None or expected_error not in raised.type_names:
        got = f"it raised {raised.raised}" if raised else "it returned normally"
        raise WrongAnswer(
            f"topk_route(x_TD, router_weight_ED, k={k}) for x_TD of shape {x_shape} and {x_dtype}, router_weight_ED "
            f"of shape {weight_shape} and {weight_dtype} must raise {expected_error}; {got}"
        )
