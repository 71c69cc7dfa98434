"""Activation checkpointing: keep a block's inputs, not its internal activations, and recompute them in backward."""

from __future__ import annotations

import torch


def checkpoint(block: torch.nn.Module, *inputs: torch.Tensor):
    """Run `block(*inputs)` keeping only `inputs` and the generator states for backward, which recomputes the rest.

    The block's parameters are passed to the autograd function as inputs too, so its outputs require grad (and its
    backward runs) whenever any parameter does, even when no input requires grad.
    """
    params = tuple(p for p in block.parameters() if p.requires_grad)
    returned = {}  # filled by forward: whether the block returned one tensor rather than a tuple
    outputs = _Recompute.apply(block, returned, len(inputs), *inputs, *params)
    return outputs[0] if returned["tensor"] else outputs


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, returned, input_count, *inputs_and_params):
        inputs = inputs_and_params[:input_count]
        device = next((x.device for x in inputs if x.is_cuda), None)
        ctx.block, ctx.device = block, device
        # The states before the block draws anything: the recomputation starts from exactly these.
        ctx.cpu_state = torch.get_rng_state()
        ctx.cuda_state = torch.cuda.get_rng_state(device) if device is not None else None
        ctx.save_for_backward(*inputs)  # references to the caller's tensors: no memory beyond what they hold anyway
        ctx.set_materialize_grads(False)
        # autograd.Function.forward already runs without recording a graph: nothing inside the block is kept.
        outputs = block(*inputs)
        returned["tensor"] = isinstance(outputs, torch.Tensor)
        return (outputs,) if returned["tensor"] else tuple(outputs)

    @staticmethod
    def backward(ctx, *output_grads):
        inputs = ctx.saved_tensors
        devices = [ctx.device] if ctx.device is not None else []
        # fork_rng restores the generators on exit, so drawing the replayed numbers leaves them as the caller had them.
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.cpu_state)
            if ctx.device is not None:
                torch.cuda.set_rng_state(ctx.cuda_state, ctx.device)
            detached = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
            with torch.enable_grad():
                outputs = ctx.block(*detached)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        pairs = [(o, g) for o, g in zip(outputs, output_grads) if g is not None and o.requires_grad]
        if pairs:
            # Parameters are leaves of the recomputed graph: their .grad accumulates here, as in a plain backward.
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = [x.grad if x.requires_grad else None for x in detached]
        parameter_count = len(ctx.needs_input_grad) - 3 - len(inputs)
        return (None, None, None, *input_grads, *([None] * parameter_count))


def checkpoint_torch(block: torch.nn.Module, *inputs: torch.Tensor):
    """The plain block, every activation saved by autograd: what checkpointing must equal."""
    return block(*inputs)
