"""Sequence parallelism for an MLP block (a student's version with one bug).

The bug: the all-gather concatenates the shards along dimension 0 (the batch), as all_gather_into_tensor lays them
out, instead of along the sequence."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


def _all_gather_tokens(x_local_BtD: Tensor, group) -> Tensor:
    """[B, t, D] on each of N ranks -> [B, N*t, D], the ranks' shards in rank order along the sequence."""
    world_size = dist.get_world_size(group)
    batch, tokens, width = x_local_BtD.shape
    # all_gather_into_tensor concatenates along dim 0, so gather rank-major and move the rank next to the sequence.
    gathered_NBtD = x_local_BtD.new_empty(world_size * batch, tokens, width)
    dist.all_gather_into_tensor(gathered_NBtD, x_local_BtD.contiguous(), group=group)
    return gathered_NBtD


def _reduce_scatter_tokens(x_BTD: Tensor, group) -> Tensor:
    """[B, T, D] partial sums on each rank -> [B, T/N, D]: rank r's slice of the sequence, summed over the ranks."""
    world_size = dist.get_world_size(group)
    batch, tokens, width = x_BTD.shape
    # reduce_scatter_tensor hands rank r the r-th block along dim 0: lay the sequence slices out rank-major first.
    rank_major_NBtD = x_BTD.unflatten(1, (world_size, tokens // world_size)).transpose(0, 1).contiguous()
    out_BtD = x_BTD.new_empty(batch, tokens // world_size, width)
    dist.reduce_scatter_tensor(out_BtD, rank_major_NBtD.flatten(0, 1), group=group)
    return out_BtD


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local_BtD: Tensor, group) -> Tensor:
        ctx.group = group
        return _all_gather_tokens(x_local_BtD, group)

    @staticmethod
    def backward(ctx, grad_BTD: Tensor):
        # Every rank used the whole gathered sequence: its gradient is a partial sum for every rank's tokens.
        return _reduce_scatter_tokens(grad_BTD, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BTD: Tensor, group) -> Tensor:
        ctx.group = group
        return _reduce_scatter_tokens(x_BTD, group)

    @staticmethod
    def backward(ctx, grad_BtD: Tensor):
        # Each rank's partial sum reached every rank's shard with weight one: each needs the whole sequence's gradient.
        return _all_gather_tokens(grad_BtD, ctx.group), None


def _check_three_dims(x: Tensor, name: str) -> None:
    if x.dim() != 3:
        raise ValueError(f"{name} must be 3-D [B, T, D], got shape {tuple(x.shape)}")


def gather_sequence(x_local_BtD: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    _check_three_dims(x_local_BtD, "x_local_BtD")
    return _GatherSequence.apply(x_local_BtD, group)


def reduce_scatter_sequence(x_BTD: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    _check_three_dims(x_BTD, "x_BTD")
    world_size = dist.get_world_size(group)
    if x_BTD.shape[1] % world_size:
        raise ValueError(f"the sequence length T={x_BTD.shape[1]} must be divisible by the world size {world_size}")
    return _ReduceScatterSequence.apply(x_BTD, group)


def _keep_mask(batch: int, tokens: int, width: int, p: float, seed: int) -> Tensor:
    """The dropout mask of the full [B, T, D] activation: the same on every rank, whatever its shard."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand((batch, tokens, width), generator=generator, dtype=torch.float32) >= p


class SequenceParallelMLPBlock(torch.nn.Module):
    def __init__(
        self,
        norm: torch.nn.LayerNorm,
        fc1: torch.nn.Linear,
        fc2: torch.nn.Linear,
        dropout_p: float,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.world_size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
        hidden = fc1.out_features
        if hidden % self.world_size:
            raise ValueError(f"the hidden size F={hidden} must be divisible by the world size {self.world_size}")
        self.dropout_p = dropout_p
        self.norm = copy.deepcopy(norm)  # replicated on every rank
        per_rank = slice(rank * hidden // self.world_size, (rank + 1) * hidden // self.world_size)
        self.fc1 = torch.nn.Linear(fc1.in_features, hidden // self.world_size, bias=fc1.bias is not None,
                                   device=fc1.weight.device, dtype=fc1.weight.dtype)
        self.fc2 = torch.nn.Linear(hidden // self.world_size, fc2.out_features, bias=fc2.bias is not None,
                                   device=fc2.weight.device, dtype=fc2.weight.dtype)
        with torch.no_grad():
            self.fc1.weight.copy_(fc1.weight[per_rank])
            if fc1.bias is not None:
                self.fc1.bias.copy_(fc1.bias[per_rank])
            self.fc2.weight.copy_(fc2.weight[:, per_rank])
            if fc2.bias is not None:
                self.fc2.bias.copy_(fc2.bias)

    def forward(self, x_local_BtD: Tensor, seed: int = 0) -> Tensor:
        # The norm and the residual act token by token: on this rank's tokens only, with no communication.
        normed_BTD = gather_sequence(self.norm(x_local_BtD), self.group)
        hidden = F.gelu(F.linear(normed_BTD, self.fc1.weight, self.fc1.bias))
        out_BtD = reduce_scatter_sequence(F.linear(hidden, self.fc2.weight), self.group)
        if self.fc2.bias is not None:
            out_BtD = out_BtD + self.fc2.bias  # once, on the summed shard
        if self.dropout_p > 0:
            batch, tokens, width = x_local_BtD.shape
            rank = dist.get_rank(self.group)
            keep = _keep_mask(batch, tokens * self.world_size, width, self.dropout_p, seed)
            keep_BtD = keep[:, rank * tokens : (rank + 1) * tokens].to(out_BtD.device)
            out_BtD = out_BtD * keep_BtD / (1 - self.dropout_p)
        return x_local_BtD + out_BtD

    def _replicated_parameters(self) -> list[torch.nn.Parameter]:
        candidates = (self.norm.weight, self.norm.bias, self.fc2.bias)
        return [p for p in candidates if p is not None and p.grad is not None]

    def all_reduce_replicated_gradients(self) -> None:
        grads = [p.grad for p in self._replicated_parameters()]
        if not grads:
            return
        # One all-reduce of the concatenated gradients rather than one per tensor: they are small.
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=self.group)
        for grad, summed in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(summed.view_as(grad))


