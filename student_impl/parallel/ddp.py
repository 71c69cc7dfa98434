"""Data parallelism: one replica of the model per rank, gradients averaged by all-reduces that overlap backward."""

from __future__ import annotations

import torch
import torch.distributed as dist  # the collectives you will need live here


class DDP(torch.nn.Module):
    """Wraps `module` so that every rank of the default process group trains the same model on its own data shard.

    Environment (set up by the caller, not by you):
      * torch.distributed is already initialised; use the default process group (gloo on CPU, NCCL on GPU, one
        GPU per rank). `dist.get_world_size()` ranks take part.
      * `module` is already on this rank's device. Its parameters and buffers may differ between ranks when DDP is
        constructed.

    Usage, per training step on every rank:
        loss = loss_fn(ddp(x_shard), y_shard)   # mean over the local shard; all shards have the same size
        loss.backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad()

    Contract:
      * Construction broadcasts every parameter and every buffer of `module` from rank 0, in place, so all ranks
        start identical. Buffers are broadcast only here, never again.
      * During backward, the moment a parameter's gradient is fully accumulated its all-reduce is issued
        asynchronously (`async_op=True`) from a hook registered with `Tensor.register_post_accumulate_grad_hook`.
        That hook fires once per backward per parameter, after all contributions to `.grad` have been summed.
        Do not issue the all-reduces after backward returns, and do not block inside the hook.
      * `finish_gradient_synchronization()` waits for every outstanding all-reduce. When it returns, on every rank
        `param.grad` of every parameter that requires grad equals the average over ranks of the local gradients:
        sum over ranks, then divide by the world size (do not use ReduceOp.AVG: gloo lacks it on older torch).
      * A parameter with `requires_grad=False` gets no hook and no communication; its `.grad` stays None.
      * A parameter reached through several module attributes (a tied weight) is the same tensor: it is broadcast
        once, gets one hook and one all-reduce per backward (deduplicate by identity).
      * One all-reduce per parameter: gradients are not bucketed.
      * Exactly one backward runs between two calls to `finish_gradient_synchronization()`, and every parameter that
        requires grad receives a gradient in every backward (no detection of unused parameters is needed).
      * `self.module` is `module` itself, the object given (as in torch's DistributedDataParallel): code that
        unwraps a trained model reads it.
      * `forward` returns exactly what `module` returns for the same arguments.
      * Do not use torch's DistributedDataParallel or FSDP.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        """Store `module`, broadcast its parameters and buffers from rank 0, register the gradient hooks."""
        raise NotImplementedError

    def forward(self, *inputs, **kwargs):
        """Call the wrapped module with the same arguments and return its output."""
        raise NotImplementedError

    def finish_gradient_synchronization(self) -> None:
        """Wait for every all-reduce issued during the last backward and leave the averaged gradient in each `.grad`."""
        raise NotImplementedError
