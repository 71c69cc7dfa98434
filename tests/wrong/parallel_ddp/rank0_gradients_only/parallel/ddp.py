"""Wrong on purpose: each gradient is broadcast from rank 0 instead of all-reduced, so every rank ends with rank 0's
local gradient (computed on rank 0's shard only) rather than the average over all shards."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist


class DDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.pending: list[dist.Work] = []
        with torch.no_grad():
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=0)
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._synchronize)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def _synchronize(self, param: torch.Tensor) -> None:
        # The bug: the ranks do agree afterwards, but on one shard's gradient, not on the average.
        self.pending.append(dist.broadcast(param.grad, src=0, async_op=True))

    def finish_gradient_synchronization(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending.clear()
