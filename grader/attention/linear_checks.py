"""The checks the three linear-attention problems grade, one function per test group: the forms against the float64
recurrence, the chunked form's gradients, the forms against one another, long decays, the state handed between two
calls, and the memory the chunked algorithm may use (grader.attention.linear_cases has the inputs and the probe)."""

from __future__ import annotations

from dataclasses import replace

import torch

from assignment.registry import Problem
from grader.attention.linear_cases import (
    CHUNK_SIZES,
    LinearCase,
    call_args,
    check_grads,
    check_memory,
    check_values,
    element_limit,
    exact,
    outputs_of,
    reference_at_dtype,
    run_form,
    upstream_of,
)
from grader.checks.outcomes import WrongAnswer


def tolerance(problem: Problem) -> dict:
    return dict(multiple=problem.error_multiple, floor_ulps=problem.floor_ulps)


def shown(case: LinearCase, form: str, chunk_size: int | None = None) -> str:
    function = getattr(case.recurrence, form)
    chunk = f", chunk_size={chunk_size or case.chunk_size}" if form == "chunked" else ""
    return f"{function}({', '.join(case.names)}{chunk})"


def check_form(student, reference, problem: Problem, case: LinearCase, form: str) -> None:
    """One form's o (and final state) against the recurrence at float64."""
    tensors = case.inputs()
    def expected():
        return exact(case, gradients=False), reference.computed(reference_at_dtype, case, tensors, False)

    report, (want, at_dtype) = run_form(student, case, form, tensors, forbidden_ops=problem.forbidden_ops,
                                        grader_work=expected)
    output, state = outputs_of(report, case, shown(case, form), case.describe())
    check_values(output, state, want, at_dtype, case, tolerance(problem), shown(case, form))


def check_backward(student, reference, problem: Problem, case: LinearCase) -> None:
    """The chunked form's outputs and the gradients of every tensor argument, from upstream gradients on o and on the
    final state."""
    tensors = case.inputs()
    report, (want, at_dtype) = run_form(
        student, case, "chunked", tensors, backward=True, forbidden_ops=problem.forbidden_ops,
        grader_work=lambda: (exact(case), reference.computed(reference_at_dtype, case, tensors, True)))
    output, state = outputs_of(report, case, shown(case, "chunked"), case.describe())
    check_values(output, state, want, at_dtype, case, tolerance(problem), shown(case, "chunked"))
    check_grads(report, want, at_dtype, case, tolerance(problem), shown(case, "chunked"))


def check_forms_agree(student, reference, problem: Problem, case: LinearCase) -> None:
    """On one input: the recurrent form and the chunked form at every chunk size each match the recurrence, so
    they agree with one another; a failure names the form that leaves the others."""
    tensors = case.inputs()
    want = exact(case, gradients=False)
    for chunk_size in CHUNK_SIZES:
        sized = replace(case, chunk_size=chunk_size)
        report, at_dtype = run_form(
            student, sized, "chunked", tensors, forbidden_ops=problem.forbidden_ops,
            grader_work=lambda: reference.computed(reference_at_dtype, sized, tensors, False))
        output, state = outputs_of(report, sized, shown(sized, "chunked"), sized.describe())
        check_values(output, state, want, at_dtype, sized,
                     tolerance(problem), f"{shown(sized, 'chunked')}, while the other chunk sizes agree so far,")
    report, _ = run_form(student, case, "recurrent", tensors, forbidden_ops=problem.forbidden_ops)
    output, state = outputs_of(report, case, shown(case, "recurrent"), case.describe())
    check_values(output, state, want, at_dtype, case, tolerance(problem),
                 f"{shown(case, 'recurrent')}, whose chunked form matches at every chunk size,")


def check_memory_discipline(student, problem: Problem, case: LinearCase) -> None:
    """Forward and backward of the chunked form build no tensor beyond element_limit (no T x T matrix, no state per
    step) and no Triton block longer than 128 along a dimension."""
    tensors = case.inputs()
    limit = element_limit(case.batch, case.heads, case.seq, case.k_dim, case.v_dim, case.chunk_size)
    report, _ = run_form(student, case, "chunked", tensors, backward=True, limit=limit,
                         forbidden_ops=problem.forbidden_ops)
    check_memory(report, case, limit, shown(case, "chunked"))


def halves(module, function: str, args: list, split: int, kwargs: dict, upstream: list) -> dict:
    """Run in the worker: the chunked form on tokens [:split], then on [split:] with the first call's final state as
    the initial state; the second call's outputs, the concatenated o, and the gradients of every argument after
    backpropagating through both calls."""
    *tensors, initial_state = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) else a for a in args]
    first = [t[:, :, :split] for t in tensors]
    second = [t[:, :, split:] for t in tensors]
    o_first, state_first = getattr(module, function)(*first, initial_state, **kwargs)
    o_second, state = getattr(module, function)(*second, state_first, **kwargs)
    output = torch.cat([o_first, o_second], dim=2)
    torch.autograd.backward([output, state], upstream)
    grads = [t.grad.detach() if t.grad is not None else None for t in [*tensors, initial_state]
             if isinstance(t, torch.Tensor)]
    return {"output": output.detach(), "state": state.detach(), "grads": grads}


def check_state_handoff(student, reference, problem: Problem, case: LinearCase, split: int) -> None:
    """Two calls with the state handed from the first to the second give the outputs, final state and gradients of
    one call over the whole sequence (the initial state's gradient included when one is given)."""
    tensors = case.inputs()
    function = case.recurrence.chunked
    context = f"{case.describe()}, split after token {split}"
    with student.describing(context):
        got, (want, at_dtype) = student.run_program_beside(
            lambda: (exact(case), reference.computed(reference_at_dtype, case, tensors, True)),
            f"{__name__}:halves", function, call_args(case, tensors), split, {"chunk_size": case.chunk_size},
            upstream_of(case, tensors))
    what = f"{function} over tokens [:{split}] then [{split}:], the state handed over"
    check_values(got["output"], got["state"], want, at_dtype, case, tolerance(problem), what)
    for name, actual in zip(case.names, got["grads"]):
        if actual is None:
            raise WrongAnswer(f"gradient of {name}: no gradient reached {name} through {what} ({context})")
    report = {"requires_grad": True, "grads": got["grads"] + ([None] if not case.initial_state else [])}
    check_grads(report, want, at_dtype, case, tolerance(problem), what)
