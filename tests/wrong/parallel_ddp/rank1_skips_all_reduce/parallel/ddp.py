"""Wrong on purpose: on rank 1 the hook of the module's first parameter issues no all-reduce, and
finish_gradient_synchronization waits until every hook has issued one. So rank 1 never returns from it, and rank 0
waits in an all-reduce that rank 1 never joins."""

from __future__ import annotations

import itertools
import time

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
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.hooked = len(trainable)
        self.skipped = trainable[0] if dist.get_rank() == 1 else None
        for param in trainable:
            param.register_post_accumulate_grad_hook(self._all_reduce)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def _all_reduce(self, param: torch.Tensor) -> None:
        if param is self.skipped:
            return
        self.pending.append((dist.all_reduce(param.grad, async_op=True), param.grad))

    def finish_gradient_synchronization(self) -> None:
        # Waits for every hook to have issued its all-reduce; on rank 1 one never does.
        while len(self.pending) < self.hooked:
            time.sleep(0.01)
        for handle, grad in self.pending:
            handle.wait()
            grad.div_(self.world_size)
        self.pending.clear()
