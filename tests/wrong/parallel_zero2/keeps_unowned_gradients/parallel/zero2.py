"""Wrong: reduces to the owner but leaves the local gradients of other parameters in place."""

from __future__ import annotations

import itertools

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


class ZeRO2(torch.nn.Module):
    """Data parallelism over the ranks of `group` in which each rank keeps only its own parameters' gradients and
    optimizer state."""

    def __init__(self, module: torch.nn.Module, optimizer_cls: type[torch.optim.Optimizer],
                 group: dist.ProcessGroup | None = None, **optimizer_kwargs) -> None:
        super().__init__()
        self.module = module
        self._group = group
        world = group if group is not None else dist.group.WORLD
        self._rank, self._world_size = dist.get_rank(group), dist.get_world_size(group)
        with torch.no_grad():
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=dist.get_global_rank(world, 0), group=group)
        self._params = [p for p in module.parameters() if p.requires_grad]
        owner_ranks = _owners([p.numel() for p in self._params], self._world_size)
        # Collectives name ranks globally, which differs from the rank inside a subgroup.
        self._owner_of = {p: dist.get_global_rank(world, owner) for p, owner in zip(self._params, owner_ranks)}
        self._owned = [p for p, owner in zip(self._params, owner_ranks) if owner == self._rank]
        # torch refuses an empty parameter list; a placeholder that never gets a gradient keeps no state.
        self.optimizer = optimizer_cls(self._owned or [torch.zeros(0, requires_grad=True)], **optimizer_kwargs)
        for param in self._params:
            param.register_post_accumulate_grad_hook(self._reduce_to_owner)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def _reduce_to_owner(self, param: torch.Tensor) -> None:
        # Only the owner needs the sum: a reduce moves half the data of an all-reduce, and every other rank can drop
        # its local gradient once the reduction has read it.
        handle = dist.reduce(param.grad, dst=self._owner_of[param], op=dist.ReduceOp.SUM, group=self._group,
                             async_op=True)
        self._pending.append((handle, param))

    def finish_gradient_synchronization(self) -> None:
        global_rank = dist.get_rank()
        for handle, param in self._pending:
            handle.wait()
            if self._owner_of[param] == global_rank:
                param.grad.div_(self._world_size)
        self._pending.clear()

    def step(self) -> None:
        self.optimizer.step()
        with torch.no_grad():
            for param in self._params:
                dist.broadcast(param, src=self._owner_of[param], group=self._group)

    def zero_grad(self) -> None:
        for param in self._owned:
            param.grad = None
