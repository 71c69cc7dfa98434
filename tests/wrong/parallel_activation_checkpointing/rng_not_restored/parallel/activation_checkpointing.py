"""Activation checkpointing with a custom autograd function that reruns the block in backward."""

from __future__ import annotations

import torch


class Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, info, n_inputs, *tensors):
        inputs = tensors[:n_inputs]
        ctx.block = block
        ctx.device = next((x.device for x in inputs if x.is_cuda), None)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(ctx.device) if ctx.device is not None else None
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)
        out = block(*inputs)
        info["single"] = isinstance(out, torch.Tensor)
        return (out,) if info["single"] else tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.saved_tensors
        # same random numbers as in forward, so dropout keeps its masks
        torch.set_rng_state(ctx.cpu_rng)
        if ctx.device is not None:
            torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
        xs = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
        with torch.enable_grad():
            out = ctx.block(*xs)
        out = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        todo = [(o, g) for o, g in zip(out, grads) if g is not None and o.requires_grad]
        if todo:
            torch.autograd.backward([o for o, _ in todo], [g for _, g in todo])
        n_params = len(ctx.needs_input_grad) - 3 - len(inputs)
        return (None, None, None, *[x.grad if x.requires_grad else None for x in xs], *[None] * n_params)


def checkpoint(block: torch.nn.Module, *inputs: torch.Tensor):
    params = [p for p in block.parameters() if p.requires_grad]
    info = {}
    outs = Recompute.apply(block, info, len(inputs), *inputs, *params)
    return outs[0] if info["single"] else outs
