"""Data parallelism: one replica of the model per rank, gradients averaged by all-reduces that overlap backward."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist


class DDP(torch.nn.Module):
    """Keeps `module` identical on every rank of the default process group by averaging its gradients.

    Each parameter's all-reduce is issued from a hook the moment backward has finished accumulating that parameter's
    gradient, so the reduction of the last layers' gradients runs while autograd is still computing the first layers'.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self._world_size = dist.get_world_size()
        # (handle, gradient) of every all-reduce issued during the current backward and not yet waited for.
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

        # parameters() and buffers() yield each tensor once even when several attributes refer to it, so a tied
        # weight gets one broadcast and one hook. Every rank walks the same module structure, so the collectives
        # below are issued in the same order everywhere, as they must be.
        with torch.no_grad():
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=0)

        for param in module.parameters():
            # A frozen parameter never gets a gradient, so it needs neither a hook nor communication.
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._all_reduce_gradient)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def _all_reduce_gradient(self, param: torch.Tensor) -> None:
        # Autograd calls this once per backward, after every contribution to param.grad has been summed into it
        # (both uses of a tied weight included), so the gradient is final here. async_op=True returns a handle at
        # once; the sum over ranks proceeds in the background (on gloo's worker threads, or on NCCL's own CUDA stream)
        # while autograd moves on to earlier layers.
        handle = dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, async_op=True)
        self._pending.append((handle, param.grad))

    def finish_gradient_synchronization(self) -> None:
        for handle, grad in self._pending:
            # On NCCL, wait() makes the current CUDA stream wait for the communication stream, so the division queued
            # after it reads the finished sum; on gloo it blocks until the sum has been written.
            handle.wait()
            # Sum then divide rather than ReduceOp.AVG, which gloo lacks on older torch.
            grad.div_(self._world_size)
        self._pending.clear()
