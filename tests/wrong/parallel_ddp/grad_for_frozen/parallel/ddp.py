"""Wrong on purpose: a zero gradient is allocated for every parameter at construction, frozen ones included, so a
frozen parameter's `.grad` is a zero tensor instead of None."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist


class DDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []
        with torch.no_grad():
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=0)
        for param in module.parameters():
            # The bug: gradient buffers allocated up front for all parameters, not only those that require grad.
            param.grad = torch.zeros_like(param)
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._all_reduce)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def _all_reduce(self, param: torch.Tensor) -> None:
        self.pending.append((dist.all_reduce(param.grad, async_op=True), param.grad))

    def finish_gradient_synchronization(self) -> None:
        for handle, grad in self.pending:
            handle.wait()
            grad.div_(self.world_size)
        self.pending.clear()
