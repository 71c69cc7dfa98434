"""Pieces shared by the graders of the MoE problems (the routers, expert choice, bias balancing, the MoE layer):
input layouts, dropping nearly tied tokens, and comparing floating outputs and gradients with a floor set by how
exactly any float32 computation can get them.
"""

from __future__ import annotations

import torch

from assignment.registry import Problem
from grader.checks.compare import assert_close, check_tensor_form
from grader.checks.outcomes import WrongAnswer

FLOAT32_EPS = torch.finfo(torch.float32).eps
# Adjacent scores that decide a discrete choice must differ by this many float32 ulps of the token's uncertainty
# scale (see clearly_ordered): several times the rounding error of any reasonable float32 computation.
TIE_MARGIN_ULPS = 16


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


def returned_fields(value, names: tuple[str, ...], function: str, context: str) -> dict:
    """The student's NamedTuple (a plain tuple once it has left the worker) by field name."""
    if not isinstance(value, tuple) or len(value) != len(names):
        raise WrongAnswer(f"{function} must return a NamedTuple of {len(names)} fields, got {value!r:.200} ({context})")
    return dict(zip(names, value))


def reference_gradients(function, args: tuple, wrt: tuple[int, ...], field: int, upstream: torch.Tensor) -> list:
    """Gradients of args[i] for i in `wrt` when output `field` of function(*args) receives `upstream`."""
    args = list(args)
    for index in wrt:
        args[index] = args[index].detach().requires_grad_(True)
    output = function(*args)[field]
    output.backward(upstream.to(output.dtype))
    return [args[index].grad for index in wrt]
