"""One call of the reference, recorded with what flows back through it, or replayed from its record."""

from __future__ import annotations

import time

import torch

from grader.expectations.digests import digest
from grader.expectations.misses import miss
from grader.expectations.values import (
    apply_side_effects,
    differentiable_inputs,
    flatten,
    leaves,
    side_effects,
    state_of,
    stored,
    substitute,
    unflatten,
)


class _RecordedCall(torch.autograd.Function):
    """Runs the reference function as one autograd node, so that what flows back through it can be recorded: the
    gradients coming in (digested: the key) and those going out to each differentiable argument."""

    @staticmethod
    def forward(ctx, call, *inputs):
        with torch.enable_grad():
            inner = [t.detach().requires_grad_() for t in inputs]
            value = call.function(*substitute(call.args, dict(zip(map(id, inputs), inner))),
                                  **substitute(call.kwargs, dict(zip(map(id, inputs), inner))))
        outputs, call.template = flatten(value)
        ctx.call, ctx.inner, ctx.outputs = call, inner, outputs
        returned = tuple(o.detach() for o in outputs)
        ctx.mark_non_differentiable(*(r for o, r in zip(outputs, returned) if not o.requires_grad))
        return returned

    @staticmethod
    def backward(ctx, *grad_outputs):
        pairs = [(o, g) for o, g in zip(ctx.outputs, grad_outputs) if o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], ctx.inner, [g for _, g in pairs], allow_unused=True)
        ctx.call.record.setdefault("backward", {})[digest(list(grad_outputs))] = [
            None if g is None else stored(g) for g in grads
        ]
        return (None, *grads)


class _ReplayedCall(torch.autograd.Function):
    """The recorded value as one autograd node whose backward returns the recorded gradients for the gradients that
    come in, or rejects the example when those were never recorded."""

    @staticmethod
    def forward(ctx, record, outputs, *inputs):
        ctx.record = record
        returned = tuple(o.clone() for o in outputs)
        ctx.mark_non_differentiable(*(r for r, flag in zip(returned, record["requires_grad"]) if not flag))
        return returned

    @staticmethod
    def backward(ctx, *grad_outputs):
        grads = ctx.record.get("backward", {}).get(digest(list(grad_outputs)))
        if grads is None:
            miss("gradients flowing back through the reference's value")
        return (None, None, *(None if g is None else g.clone() for g in grads))


class Call:
    """What _RecordedCall runs (the function and its arguments) and fills in (the record, the value's template)."""

    def __init__(self, function, args: tuple, kwargs: dict, record: dict):
        self.function, self.args, self.kwargs, self.record = function, args, kwargs, record
        self.template = None


def record_call(function, args: tuple, kwargs: dict, record: dict) -> tuple[object, dict]:
    """Call the reference function, and fill `record` with what to store of the call. A test may make the same call
    more than once (to send other gradients back through it): the record is then the same, its gradients added."""
    tensors = leaves((args, kwargs))
    before = [state_of(t) for t in tensors]
    inputs = differentiable_inputs(args, kwargs)
    started = time.monotonic()
    if inputs:
        call = Call(function, args, kwargs, record)
        outputs = _RecordedCall.apply(call, *inputs)
        value = unflatten(call.template, list(outputs))
    else:
        value = function(*args, **kwargs)
    record["seconds"] = time.monotonic() - started
    outputs, record["template"] = flatten(value)
    record["outputs"] = [stored(o) for o in outputs]
    record["requires_grad"] = [o.requires_grad for o in outputs]
    record["differentiable"] = bool(inputs)
    record["effects"] = side_effects(tensors, before)
    return value, record


def replay_call(record: dict, args: tuple, kwargs: dict, device: torch.device):
    tensors = leaves((args, kwargs))
    apply_side_effects(tensors, record["effects"])
    outputs = [o.to(device) for o in record["outputs"]]
    inputs = differentiable_inputs(args, kwargs)
    if inputs and record["differentiable"]:
        outputs = list(_ReplayedCall.apply(record, outputs, *inputs))
    else:
        outputs = [o.clone() for o in outputs]
    return unflatten(record["template"], outputs)
