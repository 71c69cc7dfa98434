"""Wrong on purpose: parameters are found by walking every submodule's own attributes, so a weight shared by two
layers is visited twice: it gets two hooks, hence two all-reduces (and two divisions) of the same gradient per
backward."""

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
            for buffer in module.buffers():
                dist.broadcast(buffer, src=0)
        # The bug: one entry per (layer, attribute), not one per distinct tensor.
        for layer in module.modules():
            for param in layer.parameters(recurse=False):
                with torch.no_grad():
                    dist.broadcast(param, src=0)
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
