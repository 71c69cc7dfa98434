"""Wrong on purpose: the all-reduced gradients are left as the sum over ranks, never divided by the world size."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist


class DDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.handles: list[dist.Work] = []
        with torch.no_grad():
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=0)
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._reduce)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def _reduce(self, param: torch.Tensor) -> None:
        self.handles.append(dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, async_op=True))

    def finish_gradient_synchronization(self) -> None:
        # The bug: the sum is the answer only for one rank; the contract asks for the average.
        for handle in self.handles:
            handle.wait()
        self.handles.clear()
