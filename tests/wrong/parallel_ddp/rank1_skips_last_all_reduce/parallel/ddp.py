"""Wrong on purpose: in the third backward, rank 1's hook of the module's first parameter (the last hook to fire)
issues no all-reduce. The grader trains three steps, so rank 1 then finishes and exits while rank 0 still waits in
that all-reduce, which fails when the connection to rank 1 closes."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

SKIPPED_BACKWARD = 3


class DDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []
        with torch.no_grad():
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=0)
        self.skipped = next(module.parameters()) if dist.get_rank() == 1 else None
        self.backwards_of_skipped = 0
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._all_reduce)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def _all_reduce(self, param: torch.Tensor) -> None:
        if param is self.skipped:
            self.backwards_of_skipped += 1
            if self.backwards_of_skipped == SKIPPED_BACKWARD:
                return
        self.pending.append((dist.all_reduce(param.grad, async_op=True), param.grad))

    def finish_gradient_synchronization(self) -> None:
        for handle, grad in self.pending:
            handle.wait()
            grad.div_(self.world_size)
        self.pending.clear()
