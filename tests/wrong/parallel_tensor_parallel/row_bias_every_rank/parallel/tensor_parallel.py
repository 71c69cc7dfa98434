"""Megatron-style tensor parallelism (a student's version with one bug).

The bug: the row-parallel layer adds its bias on every rank before the all-reduce, so the sum holds N biases."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: identity forward; backward sums the input gradient over the group (each rank saw only its shard's part)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # A private copy: autograd may hand the same gradient buffer to other consumers.
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: forward sums the ranks' partial outputs; backward is the identity (the sum's gradient reaches every term)."""

    @staticmethod
    def forward(ctx, partial: Tensor, group) -> Tensor:
        total = partial.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def copy_to_tensor_parallel_region(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    return _ReduceFromTensorParallelRegion.apply(x, group)


def _shard_size(total: int, what: str, group) -> tuple[int, int]:
    """(rank in group, size of this rank's contiguous share of `total`)."""
    world_size = dist.get_world_size(group)
    if total % world_size:
        raise ValueError(f"{what} ({total}) must be divisible by the tensor-parallel world size ({world_size})")
    return dist.get_rank(group), total // world_size


def _parameter(tensor: Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor.detach().clone())


class ColumnParallelLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        rank, rows = _shard_size(linear.out_features, "out_features", group)
        keep = slice(rank * rows, (rank + 1) * rows)
        self.weight = _parameter(linear.weight[keep])
        self.bias = None if linear.bias is None else _parameter(linear.bias[keep])

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)


class RowParallelLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        rank, columns = _shard_size(linear.in_features, "in_features", group)
        self.weight = _parameter(linear.weight[:, rank * columns : (rank + 1) * columns])
        # Replicated: added once to the reduced sum, not to each rank's partial sum.
        self.bias = None if linear.bias is None else _parameter(linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return reduce_from_tensor_parallel_region(F.linear(x, self.weight, self.bias), self.group)


class TensorParallelMLP(torch.nn.Module):
    def __init__(self, fc1: torch.nn.Linear, fc2: torch.nn.Linear, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        # GeLU acts elementwise on the hidden features, so each rank applies it to its own slice of them and the
        # hidden activations never need to be communicated: one all-reduce per forward, one per backward.
        self.fc1 = ColumnParallelLinear(fc1, group)
        self.fc2 = RowParallelLinear(fc2, group)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _grouped_by_rank(linear: torch.nn.Linear, world_size: int) -> torch.nn.Linear:
    """The fused [q; k; v] projection with its rows reordered to [q_0; k_0; v_0; q_1; k_1; v_1; ...], where q_r holds
    rank r's heads, so that a contiguous column shard holds one rank's heads of all three."""
    grouped = torch.nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        grouped.weight.copy_(linear.weight.unflatten(0, (3, world_size, -1)).transpose(0, 1).flatten(0, 2))
        if linear.bias is not None:
            grouped.bias.copy_(linear.bias.unflatten(0, (3, world_size, -1)).transpose(0, 1).flatten(0, 2))
    return grouped


class TensorParallelAttention(torch.nn.Module):
    def __init__(
        self,
        qkv: torch.nn.Linear,
        proj: torch.nn.Linear,
        num_heads: int,
        causal: bool,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        width = qkv.in_features
        if qkv.out_features != 3 * width or (proj.in_features, proj.out_features) != (width, width):
            raise ValueError(f"qkv must map D to 3D and proj D to D; got qkv {qkv.in_features}->{qkv.out_features}, "
                             f"proj {proj.in_features}->{proj.out_features}")
        if num_heads < 1 or width % num_heads:
            raise ValueError(f"D ({width}) must be divisible by num_heads ({num_heads})")
        _, self.local_heads = _shard_size(num_heads, "num_heads", group)
        self.head_dim = width // num_heads
        self.causal = causal
        self.qkv = ColumnParallelLinear(_grouped_by_rank(qkv, dist.get_world_size(group)), group)
        # The attention output is head-major, so rank r's heads are a contiguous block of proj's input columns.
        self.proj = RowParallelLinear(proj, group)

    def forward(self, x_BTD: Tensor) -> Tensor:
        batch, tokens, _ = x_BTD.shape
        q, k, v = (
            part.unflatten(-1, (self.local_heads, self.head_dim)).transpose(1, 2)
            for part in self.qkv(x_BTD).chunk(3, dim=-1)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(attended.transpose(1, 2).reshape(batch, tokens, self.local_heads * self.head_dim))


