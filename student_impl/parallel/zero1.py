"""ZeRO stage 1: optimizer state sharded over ranks, each rank stepping only the parameters it owns."""

from __future__ import annotations

import torch
import torch.distributed as dist  # the collectives you will need live here


class ShardedOptimizer:
    """An optimizer of class `optimizer_cls` whose state is split over the ranks of `group`.

    Environment (set up by the caller, not by you):
      * torch.distributed is already initialised (gloo on CPU, NCCL on GPU, one GPU per rank). `group` is the
        process group to use (None = the default world group); use only that group, with `dist.get_rank(group)` and
        `dist.get_world_size(group)`. Collectives name their source by global rank: the global rank of rank r of the
        group is `dist.get_global_rank(group, r)` (with `dist.group.WORLD` for None).
      * Every rank of the group constructs the ShardedOptimizer with the same parameters (same shapes, same order,
        same values) and calls `step()` at the same times. Before each `step()` the caller has left in `.grad` the
        gradient to apply, the same on every rank (e.g. averaged over data-parallel ranks).

    Usage, per training step on every rank:
        loss.backward()
        ...average the gradients over the ranks...
        sharded.step()
        sharded.zero_grad()

    Contract:
      * `params` is an iterable of tensors (no parameter groups); a tensor given twice counts once (keep the first
        occurrence). Parameters that do not require grad are kept in the partition like any other.
      * Partition (pinned): whole parameters. In the order given, each parameter goes to the rank of the group that
        holds the fewest elements (`numel()`) so far; on a tie, the lowest rank.
      * `self.optimizer` is an instance of `optimizer_cls(owned, **kwargs)` built over this rank's parameters only
        (`owned`: in the order given), so it creates and keeps optimizer state for those only. A rank that owns no
        parameter still builds one, over one placeholder (pinned): a tensor of 0 elements with requires_grad=True,
        on the device and in the dtype of the first parameter given; it never gets a gradient.
      * `step()` steps `self.optimizer`, then every rank receives the updated values of every parameter from its
        owner (in place: the caller's parameter tensors change). Afterwards every rank holds exactly the
        parameters the unsharded `optimizer_cls(params, **kwargs)` would have produced.
      * `zero_grad(set_to_none=True)` clears the gradients of all parameters, owned or not (None, or zeros in place
        with set_to_none=False).
      * Do not use torch.distributed.optim.ZeroRedundancyOptimizer.
    """

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], group: dist.ProcessGroup | None = None,
                 **kwargs) -> None:
        """Partition the parameters, build the inner optimizer over this rank's share."""
        raise NotImplementedError

    def step(self) -> None:
        """Step this rank's parameters with the inner optimizer, then bring every rank every updated parameter."""
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradient of every parameter (owned or not)."""
        raise NotImplementedError
