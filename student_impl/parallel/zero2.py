"""ZeRO stage 2: optimizer state and gradients sharded over ranks; each gradient is reduced to its owner only."""

from __future__ import annotations

import torch
import torch.distributed as dist  # the collectives you will need live here


class ZeRO2(torch.nn.Module):
    """Wraps `module` for data-parallel training over the ranks of `group` in which each rank keeps the gradients and
    the optimizer state of its own parameters only.

    Environment (set up by the caller, not by you):
      * torch.distributed is already initialised (gloo on CPU, NCCL on GPU, one GPU per rank). `group` is the
        process group to use (None = the default world group); use only that group, with `dist.get_rank(group)` and
        `dist.get_world_size(group)`. Collectives name ranks globally: the global rank of rank r of the group is
        `dist.get_global_rank(group, r)` (with `dist.group.WORLD` for None).
      * `module` is already on this rank's device. Its parameters and buffers may differ between ranks when ZeRO2 is
        constructed.

    Usage, per training step on every rank:
        loss = loss_fn(zero(x_shard), y_shard)   # mean over the local shard; all shards have the same size
        loss.backward()
        zero.finish_gradient_synchronization()
        zero.step()
        zero.zero_grad()

    Contract:
      * Construction broadcasts every parameter and buffer of `module` from rank 0 of the group (global rank
        `dist.get_global_rank(group, 0)`), in place.
      * Partition (pinned), over the parameters of `module.parameters()` that require grad (a tied parameter appears
        once there; frozen ones are left out): whole parameters; in that order, each goes to the rank of the group
        (numbered by `dist.get_rank(group)`, 0 to the group's size - 1) holding the fewest elements (`numel()`) so
        far; on a tie, the lowest rank. That rank is its owner.
      * `self.optimizer` is `optimizer_cls(owned, **optimizer_kwargs)` over this rank's owned parameters only (in
        partition order); a rank that owns nothing builds it over a placeholder tensor that never gets a gradient.
      * During backward, from `Tensor.register_post_accumulate_grad_hook` hooks, each parameter's gradient is sent
        to its owner with one `dist.reduce(grad, dst=<owner's global rank>, op=ReduceOp.SUM, async_op=True)` the
        moment it is final. No all-reduce: only the owner ever holds the summed gradient. Do not block inside a
        hook (no wait on the handle there).
      * `finish_gradient_synchronization()` waits for every reduce. When it returns, on each rank `param.grad` is
        the average over the group's ranks of their local gradients (sum, then divide by the group's size) for every
        parameter the rank owns, and None for every other parameter (frozen ones included): a rank holds only its
        shard of the gradients.
      * `step()` steps `self.optimizer`, then every rank receives every updated parameter from its owner, so all
        ranks hold the parameters the unsharded optimizer would have produced from the full-batch gradient.
      * `zero_grad()` sets the gradients of the owned parameters to None.
      * Exactly one backward runs between two calls to `finish_gradient_synchronization()`, and every parameter that
        requires grad receives a gradient in every backward.
      * `self.module` is `module` itself, the object given (as in torch's DistributedDataParallel): code that
        unwraps a trained model reads it.
      * `forward` returns exactly what `module` returns for the same arguments.
      * Do not use torch's DistributedDataParallel, FSDP or ZeroRedundancyOptimizer.
    """

    def __init__(self, module: torch.nn.Module, optimizer_cls: type[torch.optim.Optimizer],
                 group: dist.ProcessGroup | None = None, **optimizer_kwargs) -> None:
        """Broadcast the module from rank 0, partition its parameters, build the inner optimizer, register hooks."""
        raise NotImplementedError

    def forward(self, *inputs, **kwargs):
        """Call the wrapped module with the same arguments and return its output."""
        raise NotImplementedError

    def finish_gradient_synchronization(self) -> None:
        """Wait for every reduce; leave the averaged gradient on owned parameters and None on all others."""
        raise NotImplementedError

    def step(self) -> None:
        """Step the owned parameters, then bring every rank every updated parameter from its owner."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Set the gradients of the owned parameters to None."""
        raise NotImplementedError
