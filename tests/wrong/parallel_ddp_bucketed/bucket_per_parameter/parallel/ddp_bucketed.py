"""Wrong: one all-reduce per parameter, from its own hook; the bucket size is ignored."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist


class BucketedDDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, bucket_size_mb: float,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.module = module
        self._group = group
        self._world_size = dist.get_world_size(group)
        with torch.no_grad():
            source = dist.get_global_rank(group if group is not None else dist.group.WORLD, 0)
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=source, group=group)
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._all_reduce)
        self._pending = []

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def _all_reduce(self, param: torch.Tensor) -> None:
        handle = dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
        self._pending.append((handle, param.grad))

    def finish_gradient_synchronization(self) -> None:
        for handle, grad in self._pending:
            handle.wait()
            grad.div_(self._world_size)
        self._pending.clear()
