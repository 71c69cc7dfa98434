"""Pieces shared by the graders of the MoE problems (the routers, expert choice, bias balancing, the MoE layer):
input layouts, dropping nearly tied tokens, comparing floating outputs and gradients with a floor set by how
exactly any float32 computation can get them, and the two halves of a router's grader: RoutingCase, how a case
builds its tokens and router, and RoutingCheck, the student's and the references' routing of it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from hypothesis import assume
from hypothesis import strategies as st

from assignment.registry import Problem
from grader.checks.compare import assert_close, assert_equal, check_tensor_form
from grader.checks.outcomes import WrongAnswer
from grader.session.context import current

FLOAT32_EPS = torch.finfo(torch.float32).eps
# Adjacent scores that decide a discrete choice must differ by this many float32 ulps of the token's uncertainty
# scale (see clearly_ordered): several times the rounding error of any reasonable float32 computation.
TIE_MARGIN_ULPS = 16
LOW_PRECISION = (torch.bfloat16, torch.float16)
# (x_TD, router weight) dtypes with at least one of them low precision, either way round.
low_precision_dtypes = st.tuples(
    st.sampled_from(LOW_PRECISION), st.sampled_from((*LOW_PRECISION, torch.float32))
).flatmap(lambda pair: st.sampled_from((pair, pair[::-1])))


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


def laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as the 2-D tensor `t`, stored with one of the layouts of grader.checks.strategies.LAYOUTS."""
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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def clearly_ordered(scores_TE: torch.Tensor, take: int, uncertainty_T: torch.Tensor) -> torch.Tensor:
    """Bool [T]: rows whose `take` largest scores and the next one (if any) are ordered by gaps larger than
    TIE_MARGIN_ULPS float32 ulps of the row's uncertainty scale. Excluded entries may be -inf (at most one of them
    among the `take` + 1 largest)."""
    top = min(take + 1, scores_TE.shape[-1])
    sorted_TE = scores_TE.sort(dim=-1, descending=True).values[:, :top]
    gaps_TE = sorted_TE[:, :-1] - sorted_TE[:, 1:]
    return (gaps_TE > TIE_MARGIN_ULPS * FLOAT32_EPS * uncertainty_T[:, None]).all(dim=-1)


def compare_floating(actual, exact: torch.Tensor, expected_at_dtype: torch.Tensor, floor_scale: float,
                     problem: Problem, what: str, context: str) -> None:
    """assert_close with the error floor problem.floor_ulps ulps of floor_scale (or of the result, if larger).

    Two kinds of result assert_close cannot judge are compared here with the same bound: a result far below the
    floor (an output that, exactly, does not depend on an input, such as renormalised gates with k = 1, where
    rounding may leave exactly zero and float64 a trace) and values that differ by less than the tolerance and
    may round to one value.
    """
    check_tensor_form(actual, expected_at_dtype, what, context)
    exact64 = exact.double().cpu()
    result_scale = float(exact64.abs().max()) if exact64.numel() else 0.0
    floor_scale = max(floor_scale, result_scale)
    eps = torch.finfo(actual.dtype).eps
    reference_error = float((expected_at_dtype.double().cpu() - exact64).abs().max()) if exact64.numel() else 0.0
    allowed = problem.error_multiple * reference_error + problem.floor_ulps * eps * floor_scale
    negligible = result_scale <= problem.floor_ulps * eps * floor_scale
    may_round_to_constant = exact64.numel() > 1 and float(exact64.max() - exact64.min()) <= 2 * allowed
    if not (negligible or may_round_to_constant):
        assert_close(actual, exact, expected_at_dtype, what=what, context=context, multiple=problem.error_multiple,
                     floor_ulps=problem.floor_ulps * floor_scale / result_scale)
        return
    error = float((actual.double().cpu() - exact64).abs().max()) if exact64.numel() else 0.0
    if not error <= allowed:  # NaN fails too
        raise WrongAnswer(
            f"{what}: out of tolerance; largest error {error:.3g}, allowed {allowed:.3g} = {problem.error_multiple:g}"
            f" x reference error {reference_error:.3g} + {problem.floor_ulps:g} ulp x scale {floor_scale:.3g}"
            f" ({context})"
        )


def compare_gradients(actual: list, exact: list, at_dtype: list, names: tuple[str, ...],
                      floor_scales: tuple[float, ...], problem: Problem, source: str, context: str) -> None:
    """compare_floating for the gradient of each named input (`source` says which output it came from, e.g.
    " from gate_TK"), and a failure that says so for an input that received none."""
    for index, name in enumerate(names):
        what = f"gradient of {name}{source}"
        if actual[index] is None:
            raise WrongAnswer(f"{what}: {name} received no gradient ({context})")
        compare_floating(actual[index], exact[index], at_dtype[index], floor_scales[index], problem, what, context)


def router_term_scales(per_token_T: torch.Tensor, x_TD: torch.Tensor, weight_ED: torch.Tensor) -> tuple[float, float]:
    """How large the terms are that a backward pass sums into grad x_TD and grad weight_ED, when `per_token_T[t]`
    is the size of the gradient reaching token t's logits x_t . w_e (times their uncertainty): each logit's gradient
    times the other operand of its product."""
    per_token_T, x_TD, weight_ED = (t.double().cpu() for t in (per_token_T, x_TD, weight_ED))
    return (float((per_token_T[:, None] * weight_ED.abs().amax(dim=0)).max()),
            float((per_token_T @ x_TD.abs()).max()))


def returned_fields(value, names: tuple[str, ...], function: str, context: str, output: str = "a NamedTuple") -> dict:
    """The student's NamedTuple (a plain tuple once it has left the worker) by field name; `output` names it in the
    failure message (e.g. "a RouterOutput")."""
    if not isinstance(value, tuple) or len(value) != len(names):
        raise WrongAnswer(f"{function} must return {output} of {len(names)} fields, got {value!r:.200} ({context})")
    return dict(zip(names, value))


def reference_gradients(function, args: tuple, wrt: tuple[int, ...], field: int, upstream: torch.Tensor) -> list:
    """Gradients of args[i] for i in `wrt` when output `field` of function(*args) receives `upstream`."""
    args = list(args)
    for index in wrt:
        args[index] = args[index].detach().requires_grad_(True)
    output = function(*args)[field]
    output.backward(upstream.to(output.dtype))
    return [args[index].grad for index in wrt]


class RoutingCase:
    """What the routers' cases share: tokens x_TD [T, D] and router weights [E, D] drawn from `seed`, held by
    exact_inputs (x_TD first, then the router weights) in float64 at exactly the values the student receives, and
    given by inputs in the case's dtypes and layouts. A subclass defines exact_inputs and describe.

    Not a dataclass: a base's fields would come first in every case's repr, which hypothesis prints for a failing
    example (and students reproduce it from), so each case declares these fields itself, in its own order.
    """

    tokens: int
    width: int
    experts: int
    x_dtype: torch.dtype
    weight_dtype: torch.dtype
    x_layout: str
    weight_layout: str
    logit_scale: float
    seed: int

    def normal_draw(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """2 T Gaussian tokens (the case keeps the first T it can judge) and a Gaussian router scaled so that the
        logits' standard deviation is logit_scale, in float64."""
        x_TD = torch.randn(2 * self.tokens, self.width, generator=generator, dtype=torch.float64)
        weight_ED = torch.randn(self.experts, self.width, generator=generator, dtype=torch.float64)
        return x_TD, weight_ED * (self.logit_scale / self.width**0.5)

    def integer_draw(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """T tokens in [-2, 2] and a router in [-1, 1], in float64: integer logits are exact in float32, so equal
        ones are exactly equal."""
        x_TD = torch.randint(-2, 3, (self.tokens, self.width), generator=generator).double()
        weight_ED = torch.randint(-1, 2, (self.experts, self.width), generator=generator).double()
        return x_TD, weight_ED

    def as_received(self, x_TD: torch.Tensor, *weights_ED: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x_TD and the router weights in float64, rounded to the values they take in the case's dtypes."""
        return (x_TD.to(self.x_dtype).double(), *(weight.to(self.weight_dtype).double() for weight in weights_ED))

    def laid_out_inputs(self, x_TD: torch.Tensor, *weights_ED: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x_TD and the router weights in the case's dtypes, layouts and device; an example with no token is
        dropped."""
        assume(x_TD.shape[0] > 0)
        device = current().device
        return (
            laid_out(x_TD.to(device, self.x_dtype), self.x_layout),
            *(laid_out(weight.to(device, self.weight_dtype), self.weight_layout) for weight in weights_ED),
        )

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """exact_inputs as the student receives them."""
        return self.laid_out_inputs(*self.exact_inputs())

    def normal_described(self, also: str = "") -> str:
        """What "normal" values are, `also` naming the case's further scales."""
        return f"normal with logit scale {self.logit_scale:g}{also}, of {2 * self.tokens} tokens those not nearly tied"

    def layouts_described(self, weights: str = "router_weight_ED") -> str:
        return (f"x_TD {dtype_name(self.x_dtype)} {self.x_layout}, {weights} {dtype_name(self.weight_dtype)} "
                f"{self.weight_layout}")


class RoutingCheck(ABC):
    """The student's routing of one case, the fast reference's at the case's dtypes (whose integer outputs must be
    matched exactly and whose float32 error calibrates the tolerances) and the plain reference's in float64.

    A subclass names its problem, the contract's function (the plain reference is that name with "_torch") and
    its output fields, and says how exactly any float32 computation can get its floating outputs (the floor_scale
    it gives check_floating) and gradients (gradient_term_scales). Each module calls its subclass Routing and keeps
    its tests' source as it was: in the derandomised profiles, a test's source seeds hypothesis's draws.
    """

    problem: Problem
    function: str
    fields: tuple[str, ...]
    output = "a NamedTuple"  # what the function returns, as a failure names it
    differentiable: tuple[str, ...]  # the outputs a gradient is backpropagated from
    input_names = ("x_TD", "router_weight_ED")  # the leading tensors of the call, as a gradient's failure names them

    def __init__(self, student, reference, case: RoutingCase):
        self.student, self.reference, self.case = student, reference, case
        self.tensors = case.inputs()
        self.context = case.describe(self.tensors[0])
        self.args = (*self.tensors, *self.options())
        with student.describing(self.context):
            value = student.call(self.function, *self.args)
        self.actual = returned_fields(value, self.fields, self.function, self.context, self.output)
        with torch.no_grad():
            self.at_dtype = dict(zip(self.fields, self.fast(*self.args)))
            self.exact = dict(zip(self.fields, self.plain(*self.exact_args())))

    @property
    def x_TD(self) -> torch.Tensor:
        return self.tensors[0]

    @property
    def weight_ED(self) -> torch.Tensor:
        return self.tensors[1]

    @property
    def fast(self):
        return getattr(self.reference, self.function)

    @property
    def plain(self):
        return getattr(self.reference, f"{self.function}_torch")

    @abstractmethod
    def options(self) -> tuple:
        """The arguments of the student's call after the tensors."""

    def exact_args(self) -> tuple:
        """The plain reference's arguments: the tensors in float64."""
        return (*(t.double() for t in self.tensors), *self.options())

    def wrt(self) -> tuple[int, ...]:
        """The indices of the inputs whose gradients are checked."""
        return (0, 1)

    @abstractmethod
    def gradient_term_scales(self, field: str, upstream: torch.Tensor) -> tuple[float, ...]:
        """For each input (input_names), how large the terms are that a backward pass from `field` sums into its
        gradient (see compare_gradients)."""

    def check_equal(self, name: str) -> None:
        assert_equal(self.actual[name], self.at_dtype[name], what=name, context=self.context)

    def check_floating(self, name: str, floor_scale: float) -> None:
        """Output `name` against the plain reference, allowed floor_ulps ulps of floor_scale (see compare_floating)."""
        compare_floating(self.actual[name], self.exact[name], self.at_dtype[name], floor_scale, self.problem, name,
                         self.context)

    def check_gradients(self) -> None:
        """Backpropagate a random upstream gradient from each differentiable output in turn: a gradient too small to
        notice beside the others' still has to be right."""
        generator = torch.Generator().manual_seed(self.case.seed + 1)
        for field in self.differentiable:
            upstream = torch.randn(self.exact[field].shape, generator=generator, dtype=torch.float64).float()
            self.check_gradients_from(field, upstream.to(current().device))

    def check_gradients_from(self, field: str, upstream: torch.Tensor) -> None:
        wrt = self.wrt()
        grad = {"inputs": list(wrt), "upstream": [upstream if name == field else None for name in self.fields]}
        with self.student.describing(self.context):
            actual = self.student.call_traced(self.function, *self.args, grad=grad)["grads"]
        index = self.fields.index(field)
        exact = reference_gradients(self.plain, self.exact_args(), wrt, index, upstream)
        at_dtype = reference_gradients(self.fast, self.args, wrt, index, upstream)
        term_scales = self.gradient_term_scales(field, upstream)
        compare_gradients(actual, exact, at_dtype, tuple(self.input_names[i] for i in wrt),
                          tuple(term_scales[i] for i in wrt), self.problem, f" from {field}", self.context)


class SigmoidGating(RoutingCheck):
    """A routing whose gates are renormalised sigmoid affinities times the case's route_scale (moe.sigmoid_router,
    moe.group_limited_routing).

    Floors: a float32 logit is exact only to a few ulps of max_e sum_d |x_d w_ed| =: U_t, so an affinity is
    relatively uncertain by about U_t + 1 ulps, and so is every gate, whatever the algorithm.
    """

    differentiable = ("gate_TK",)

    def __init__(self, student, reference, case: RoutingCase):
        super().__init__(student, reference, case)
        x64, weight64 = self.x_TD.double().cpu(), self.weight_ED.double().cpu()
        self.uncertainty_T = 1 + (x64.abs() @ weight64.abs().T).amax(dim=-1)

    def check_gates(self) -> None:
        self.check_floating("gate_TK", self.case.route_scale * float(self.uncertainty_T.max()))

    def gradient_term_scales(self, field: str, upstream: torch.Tensor) -> tuple[float, float]:
        # Per token, the backward pass sums terms of about route_scale * |upstream| into each logit, each
        # uncertain by U_t ulps, then multiplies them by the other operand of the logit's product.
        per_token_T = self.case.route_scale * upstream.double().cpu().abs().sum(dim=-1) * self.uncertainty_T
        return router_term_scales(per_token_T, self.x_TD, self.weight_ED)
