"""Data parallelism with gradient buckets: one all-reduce per bucket of gradients, issued as soon as it is complete."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

BYTES_PER_MB = 2**20


def _bucket_partition(module: torch.nn.Module, bucket_size_mb: float) -> list[list[torch.nn.Parameter]]:
    """The pinned buckets: trainable parameters in reverse order of `module.parameters()`, each bucket closed when the
    next parameter would take it past `bucket_size_mb` MB or has another dtype; a parameter larger than the limit
    fills a bucket alone."""
    limit_bytes = bucket_size_mb * BYTES_PER_MB
    buckets, current, current_bytes = [], [], 0
    for param in reversed([p for p in module.parameters() if p.requires_grad]):
        size = param.numel() * param.element_size()
        # A bucket travels as one flat tensor, so it holds one dtype: a parameter of another closes it as if full.
        if current and (param.dtype != current[0].dtype or current_bytes + size > limit_bytes):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(param)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.waiting = len(params)  # gradients not yet final in the current backward
        self.flat = None  # the concatenated gradients while their all-reduce is in flight
        self.handle = None


class BucketedDDP(torch.nn.Module):
    """Averages the gradients of `module` over the ranks of `group` with one asynchronous all-reduce per bucket."""

    def __init__(self, module: torch.nn.Module, bucket_size_mb: float,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.module = module
        self._group = group
        self._world_size = dist.get_world_size(group)
        with torch.no_grad():
            # broadcast names its source by global rank; rank 0 of the group is not global rank 0 in general.
            source = dist.get_global_rank(group if group is not None else dist.group.WORLD, 0)
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=source, group=group)
        self._buckets = [_Bucket(params) for params in _bucket_partition(module, bucket_size_mb)]
        for bucket in self._buckets:
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(self._hook_for(bucket))
        self._in_flight: list[_Bucket] = []

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def _hook_for(self, bucket: _Bucket):
        def gradient_ready(param: torch.Tensor) -> None:
            bucket.waiting -= 1
            if bucket.waiting == 0:
                # One message for the whole bucket: a copy of each gradient into a flat buffer costs one read and one
                # write of the bucket, far less than the per-message latency it saves on many small gradients.
                bucket.flat = torch.cat([p.grad.reshape(-1) for p in bucket.params])
                bucket.handle = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
                self._in_flight.append(bucket)

        return gradient_ready

    def finish_gradient_synchronization(self) -> None:
        for bucket in self._in_flight:
            bucket.handle.wait()
            bucket.flat.div_(self._world_size)
            offset = 0
            for param in bucket.params:
                count = param.numel()
                param.grad.copy_(bucket.flat[offset:offset + count].view_as(param.grad))
                offset += count
            bucket.flat, bucket.handle, bucket.waiting = None, None, len(bucket.params)
        self._in_flight.clear()
