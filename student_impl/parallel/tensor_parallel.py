"""Megatron-style tensor parallelism: column- and row-parallel linear layers, an MLP and an attention block.

Environment (set up by the caller, not by you): torch.distributed is initialised (gloo on CPU, NCCL with one GPU
per rank). Every function and class takes `group`: the process group of the tensor-parallel ranks, None meaning
the default (world) group. Use only that group: pass it to every collective, and take this rank's index and the
number of ranks N from `dist.get_rank(group)` and `dist.get_world_size(group)`. Every rank of the group calls
the same constructors with the same full weights, and the same forward and backward.

The conjugate pair (write each as a torch.autograd.Function):
  * f = `copy_to_tensor_parallel_region`: forward is the identity; backward all-reduces (sums) the gradient.
  * g = `reduce_from_tensor_parallel_region`: forward all-reduces (sums) the input; backward is the identity.
Neither modifies its argument in place.

Sharding (r = this rank's index in `group`, N = its size; constructors copy their shard out of the full weights
they are given, and keep parameters with the same device and dtype):
  * ColumnParallelLinear(linear): `weight` = linear.weight[r*O/N:(r+1)*O/N] ([O/N, I]), `bias` = the same rows
    of linear.bias ([O/N]), or None when linear.bias is None. O % N != 0 raises ValueError.
  * RowParallelLinear(linear): `weight` = linear.weight[:, r*I/N:(r+1)*I/N] ([O, I/N]); `bias` = the full
    linear.bias ([O], replicated on every rank), or None. I % N != 0 raises ValueError.
Parameters are `nn.Parameter`s that require grad, registered under exactly the names given (the grader reads
`named_parameters()`); nothing else is registered as a parameter.

Communication, exactly (the grader counts every collective, and its bytes):
  * ColumnParallelLinear: none in forward; one all-reduce of the input gradient (f) in backward.
  * RowParallelLinear: one all-reduce of the [..., O] output in forward (g); none in backward.
  * TensorParallelMLP and TensorParallelAttention: one all-reduce of the [..., D] output in forward, one
    of the [..., D] input gradient in backward. Nothing else: no all-reduce between the two linear
    layers, no broadcast.
No collective in constructors is required (every rank already holds the same full weights); the grader does not
count them there.
Do not use torch.distributed.tensor (DTensor, parallelize_module) or torch.distributed.nn.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # the collectives you will need live here
from torch import Tensor


def copy_to_tensor_parallel_region(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """f: returns x unchanged (same values, any shape); in backward, the gradient is all-reduced (summed) over `group`.

    Put it in front of a column-parallel layer whose input is replicated: each rank's backward produces only its
    shard's part of the input gradient, and the sum is the full one.
    """
    raise NotImplementedError


def reduce_from_tensor_parallel_region(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """g: returns the sum over `group` of every rank's x (a new tensor; x is not modified); backward is the identity.

    Put it after a row-parallel layer: each rank holds a partial sum of the output.
    """
    raise NotImplementedError


class ColumnParallelLinear(torch.nn.Module):
    """A linear layer whose output features are split across the ranks of `group`.

    Input x: [..., I], the same on every rank (replicated). Output: [..., O/N], this rank's output features
    r*O/N..(r+1)*O/N of linear(x) (it stays sharded: there is no gather of the output).
    Parameters: `weight` [O/N, I], `bias` [O/N] or None (see the module docstring).
    """

    def __init__(self, linear: torch.nn.Linear, group: dist.ProcessGroup | None = None) -> None:
        """Keep rank r's rows of `linear`'s weight and bias; ValueError if linear.out_features % N != 0."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        """f, then x @ weight.T + bias on this rank's shard."""
        raise NotImplementedError


class RowParallelLinear(torch.nn.Module):
    """A linear layer whose input features are split across the ranks of `group`.

    Input x: [..., I/N], this rank's input features r*I/N..(r+1)*I/N (what a ColumnParallelLinear outputs). Output:
    [..., O], the full linear(x_full), identical on every rank.
    Parameters: `weight` [O, I/N], `bias` [O] or None (see the module docstring).
    The bias is added once, after the all-reduce of the partial products x @ weight.T; its gradient is therefore the
    full bias gradient on every rank.
    """

    def __init__(self, linear: torch.nn.Linear, group: dist.ProcessGroup | None = None) -> None:
        """Keep rank r's columns of `linear`'s weight and the whole bias; ValueError if linear.in_features % N != 0."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        """g(x @ weight.T), then + bias."""
        raise NotImplementedError


class TensorParallelMLP(torch.nn.Module):
    """fc2(gelu(fc1(x))) with fc1 column-parallel and fc2 row-parallel.

    fc1: Linear(D, F), fc2: Linear(F, D), each with or without bias; F % N != 0 raises ValueError. GeLU is the exact
    (erf) form, torch.nn.functional.gelu's default. Input and output: [..., D], replicated.
    Submodules, exactly: `fc1` a ColumnParallelLinear of fc1 and `fc2` a RowParallelLinear of fc2, so the parameters
    are `fc1.weight` [F/N, D], `fc1.bias` [F/N], `fc2.weight` [D, F/N], `fc2.bias` [D].
    """

    def __init__(self, fc1: torch.nn.Linear, fc2: torch.nn.Linear, group: dist.ProcessGroup | None = None) -> None:
        """Shard fc1 by output features and fc2 by input features."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        """[..., D] -> [..., D]: one all-reduce in forward, one in backward."""
        raise NotImplementedError


class TensorParallelAttention(torch.nn.Module):
    """Multi-head self-attention with the heads split across the ranks of `group`.

    The single-rank module it reproduces, for x of shape [B, T, D], H = num_heads heads of size d = D/H:
        q, k, v = (x @ qkv.weight.T + qkv.bias).split(D, dim=-1)  # each [B, T, D], head h in columns h*d..(h+1)*d
        per head: softmax(q_h k_h^T / sqrt(d) + mask) v_h          # mask: -inf above the diagonal if causal, else 0
        out = concat_heads(...) @ proj.weight.T + proj.bias        # heads concatenated in order, [B, T, D]
    No dropout. qkv: Linear(D, 3D), proj: Linear(D, D), each with or without bias.

    Rank r computes heads r*H/N..(r+1)*H/N (each head whole: split the heads, never the head dimension d).
    ValueError if qkv is not D -> 3D or proj not D -> D, if D % num_heads != 0, or if num_heads % N != 0.
    Submodules, exactly:
      * `qkv`: a ColumnParallelLinear whose `weight` [3D/N, D] is the concatenation of rank r's rows of the q, k and
        v parts, in that order: rows r*D/N..(r+1)*D/N of each of the blocks qkv.weight[0:D], [D:2D], [2D:3D]
        (`bias` [3D/N] likewise). This is NOT the contiguous slice r of the fused weight.
      * `proj`: a RowParallelLinear of proj (`weight` [D, D/N] = columns r*D/N..(r+1)*D/N, `bias` [D]).
    Input and output: [B, T, D], replicated. One all-reduce in forward, one in backward.
    """

    def __init__(
        self,
        qkv: torch.nn.Linear,
        proj: torch.nn.Linear,
        num_heads: int,
        causal: bool,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """Shard qkv by heads (see the class docstring) and proj by input features."""
        raise NotImplementedError

    def forward(self, x_BTD: Tensor) -> Tensor:
        """[B, T, D] -> [B, T, D], attention over this rank's heads, then the row-parallel projection."""
        raise NotImplementedError
