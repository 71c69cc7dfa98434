"""Wrong on purpose: parameters are broadcast at construction but buffers are not, so a buffer that differs between
ranks (here one that scales the input) stays different."""

from __future__ import annotations

import torch
import torch.distributed as dist


class DDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []
        with torch.no_grad():
            # The bug: buffers are not trained, so they were assumed not to need synchronising.
            for param in module.parameters():
                dist.broadcast(param, src=0)
        for param in module.parameters():
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
