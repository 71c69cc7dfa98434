"""Fully sharded data parallelism (ZeRO-3): parameters sharded per unit, gathered only while a unit computes."""

from __future__ import annotations

import torch
import torch.distributed as dist  # the collectives you will need live here


class FSDP(torch.nn.Module):
    """Wraps `module` so that each rank stores only its shard of every unit's parameters.

    Environment (set up by the caller, not by you):
      * torch.distributed is initialised. Use only `group` (None: the default world group), with this rank's index
        `dist.get_rank(group)` and `W = dist.get_world_size(group)`, so the wrapper composes with other parallelism.
      * `module` is on this rank's device (CPU with gloo, one GPU per rank with NCCL), in float32, with
        identical parameters on every rank (no broadcast is needed). Each rank feeds it its own
        equal-sized shard of the batch.

    Units:
      * Every direct child of `module` (`module.named_children()`) that holds a parameter with requires_grad=True is
        one unit. Raise ValueError, before any communication, if `module` registers a parameter itself (outside its
        children), or if one Parameter is reachable under two names (tied weights are not supported: check
        `module.named_parameters(remove_duplicate=False)`), naming the offending parameter.
      * A unit's flat parameter is the concatenation of `p.reshape(-1)` over its parameters with requires_grad=True,
        in `unit.named_parameters()` order, padded with zeros to a multiple of W elements. Rank r's shard (r =
        `dist.get_rank(group)`, not the global rank) is elements [r * S, (r + 1) * S) of it, S = padded length / W.
      * Parameters with requires_grad=False are not sharded: they stay in the module as they are, on every rank, and
        take part in no communication. (The grader does not combine them with `compute_dtype`.)

    Sharding: the constructor replaces each unit's trainable parameters by its shard, a float32 `nn.Parameter` of S
    elements, returned by `sharded_parameters()` in unit order. Only the shards persist between steps; the optimizer
    is built on them. After construction no full trainable parameter may remain referenced anywhere.

    Per step, on every rank:
        loss = loss_fn(fsdp(x_shard).float(), y_shard)   # mean over the local rows
        loss.backward()
        optimizer.step(); optimizer.zero_grad()
      * Forward: before a unit's forward, all-gather its flat parameter (one all_gather_into_tensor or all_gather
        per unit) and point the unit's parameter attributes at views of the gathered tensor; after the unit's
        forward, free the gathered storage. Autograd still refers to the views it saved: free the storage itself
        (`tensor.untyped_storage().resize_(0)`), not just your reference.
      * Backward: before the unit's backward, all-gather its flat parameter again (one per unit) into storage that
        autograd's saved views see; once the unit's gradients are complete, free it, and reduce-scatter the unit's
        full flat gradient (one reduce_scatter_tensor or reduce_scatter per unit, issued during backward) so that
        each rank gets its shard of the sum over the group's ranks, then divide by W: the shard's `.grad`
        (float32, S elements, accumulated into an existing `.grad` as autograd would) is the average over ranks,
        exactly the full-batch gradient. Padding elements get gradient zero. When `loss.backward()` returns every
        shard's `.grad` is final.
      * No other collective is issued during forward and backward (no all_reduce). At most two units' parameters
        are gathered at any moment: the grader measures each rank's peak tensor bytes during a step and allows
        4 x (the largest unit's gathered bytes) + twice the activations' bytes above what the rank held before it.
      * compute_dtype (e.g. torch.bfloat16): shards stay float32 (the master copy the optimizer updates). Each
        shard is cast to compute_dtype before the all-gather (the all-gathers carry compute_dtype), the unit's
        floating-point tensor arguments are cast to compute_dtype before its forward, the unit computes and returns
        compute_dtype, its flat gradient is reduce-scattered in compute_dtype and the average is cast to float32
        into the shard's `.grad`.
      * `forward` returns what `module` returns. A unit may return a tuple of tensors, some of which need no
        gradient (an integer count, say): only those that require grad lead to its backward.
      * Do not use torch's FSDP, DDP, DTensor or torch.distributed.tensor.
    """

    def __init__(self, module: torch.nn.Module, compute_dtype: torch.dtype | None = None,
                 group: dist.ProcessGroup | None = None) -> None:
        """Validate, shard every unit's trainable parameters, install the gather/free/reduce-scatter hooks."""
        raise NotImplementedError

    def forward(self, *inputs, **kwargs):
        """Call the wrapped module (units gather and free their parameters around their own forward)."""
        raise NotImplementedError

    def sharded_parameters(self) -> list[torch.nn.Parameter]:
        """This rank's float32 shard of each unit's flat parameter, in `module.named_children()` order."""
        raise NotImplementedError

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """On every rank: every parameter of the wrapped module at full size, float32, keyed by its name in the
        original `module.named_parameters()` (e.g. "block0.first.weight"), as new tensors (not views of internal
        buffers) on the module's device. Trainable ones are all-gathered from the shards (one all-gather per unit,
        in float32 whatever compute_dtype is); frozen ones are copied as they are. Collective: every rank calls it."""
        raise NotImplementedError
