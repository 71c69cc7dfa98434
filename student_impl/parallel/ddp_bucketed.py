"""Data parallelism with gradient buckets: one all-reduce per bucket of gradients,
issued as soon as it is complete."""

from __future__ import annotations

import torch
import torch.distributed as dist  # the collectives you will need live here


class BucketedDDP(torch.nn.Module):
    """Wraps `module` so that every rank of `group` trains the same model on its own data shard, averaging gradients
    with one all-reduce per bucket of gradients instead of one per parameter.

    Environment (set up by the caller, not by you):
      * torch.distributed is already initialised (gloo on CPU, NCCL on GPU, one GPU per rank). `group` is the
        process group to use (None = the default world group); use only that group, with `dist.get_rank(group)` and
        `dist.get_world_size(group)`. Collectives name their source by global rank: rank 0 of the group is
        `dist.get_global_rank(group, 0)` (with `dist.group.WORLD` for None).
      * `module` is already on this rank's device. Its parameters and buffers may differ between ranks when
        BucketedDDP is constructed.

    Usage, per training step on every rank:
        loss = loss_fn(ddp(x_shard), y_shard)   # mean over the local shard; all shards have the same size
        loss.backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad()

    Contract:
      * Construction broadcasts every parameter and every buffer of `module` from rank 0 of the group, in place.
      * Buckets (pinned): take the parameters of `module.parameters()` that require grad (a tied parameter appears
        once there; frozen ones are left out) in REVERSE order, the order in which backward roughly produces their
        gradients. Walk them, adding each to the current bucket; when the current bucket is non-empty and adding the
        next parameter would take its size past `bucket_size_mb * 2**20` bytes, close it and start a new bucket with
        that parameter. A parameter's size is `numel() * element_size()` bytes. So a parameter larger than the limit
        gets a bucket of its own, and a limit larger than the whole model gives one bucket. A bucket holds
        parameters of one dtype only: when the next parameter's dtype differs from the current bucket's, the current
        bucket closes (as if full) and that parameter starts a new one, so no gradient is cast to join a bucket.
      * Per backward, exactly one all-reduce per bucket, of one tensor holding the bucket's gradients concatenated
        (its size in bytes is the sum of the bucket's parameter sizes), issued with `async_op=True` during backward
        from `Tensor.register_post_accumulate_grad_hook` hooks, at the moment the last gradient of the bucket
        becomes final (not later, e.g. not when the whole backward has finished). Do not block inside a hook.
      * `finish_gradient_synchronization()` waits for every outstanding all-reduce. When it returns, on every rank
        `param.grad` of every parameter that requires grad equals the average over ranks of the local gradients
        (sum with ReduceOp.SUM, then divide by the world size). No other collective is issued during a step.
      * A parameter with `requires_grad=False` gets no hook and no communication; its `.grad` stays None.
      * Exactly one backward runs between two calls to `finish_gradient_synchronization()`, and every parameter that
        requires grad receives a gradient in every backward.
      * `self.module` is `module` itself, the object given (as in torch's DistributedDataParallel): code that
        unwraps a trained model reads it.
      * `forward` returns exactly what `module` returns for the same arguments.
      * Do not use torch's DistributedDataParallel or FSDP.
    """

    def __init__(self, module: torch.nn.Module, bucket_size_mb: float,
                 group: dist.ProcessGroup | None = None) -> None:
        """Store `module`, broadcast its parameters and buffers from rank 0, build the buckets, register the hooks."""
        raise NotImplementedError

    def forward(self, *inputs, **kwargs):
        """Call the wrapped module with the same arguments and return its output."""
        raise NotImplementedError

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce of the last backward and leave the averaged gradient in each `.grad`."""
        raise NotImplementedError
