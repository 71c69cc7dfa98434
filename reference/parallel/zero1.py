"""ZeRO stage 1: optimizer state sharded over ranks, each rank stepping only the parameters it owns."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _owners(sizes: list[int], world_size: int) -> list[int]:
    """Pinned partition: in order, each parameter goes to the rank holding the fewest elements so far (lowest rank
    on a tie)."""
    held = [0] * world_size
    assigned = []
    for size in sizes:
        rank = min(range(world_size), key=lambda r: (held[r], r))
        held[rank] += size
        assigned.append(rank)
    return assigned


def _unique(params) -> list[torch.Tensor]:
    seen, kept = set(), []
    for param in params:
        if id(param) not in seen:
            seen.add(id(param))
            kept.append(param)
    return kept


class ShardedOptimizer:
    """Wraps `optimizer_cls` so that each rank of `group` keeps state for, and steps, only its own parameters."""

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], group: dist.ProcessGroup | None = None,
                 **kwargs) -> None:
        self.params = _unique(params)
        self._group = group
        world = group if group is not None else dist.group.WORLD
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        self.owner_ranks = _owners([p.numel() for p in self.params], world_size)
        # broadcast names its source by global rank, which differs from the rank inside a subgroup.
        self._sources = [dist.get_global_rank(world, owner) for owner in self.owner_ranks]
        mine = [p for p, owner in zip(self.params, self.owner_ranks) if owner == rank]
        # A rank that owns nothing still needs an optimizer object; torch refuses an empty parameter list. The
        # placeholder sits where the parameters do, so nothing the optimizer keeps lands on another device.
        placeholder = torch.zeros(0, device=self.params[0].device, dtype=self.params[0].dtype, requires_grad=True)
        self.optimizer = optimizer_cls(mine or [placeholder], **kwargs)

    def step(self) -> None:
        self.optimizer.step()
        # Every rank then receives the owner's updated values: one broadcast per parameter, in the same order on
        # every rank. Parameters are leaves that require grad, so in-place writes need no_grad.
        with torch.no_grad():
            for param, source in zip(self.params, self._sources):
                dist.broadcast(param, src=source, group=self._group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.zero_()
