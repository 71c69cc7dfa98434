"""Sequence parallelism for the norm and dropout regions of a tensor-parallel MLP block.

Environment (set up by the caller, not by you): torch.distributed is initialised (gloo on CPU, NCCL with one GPU
per rank). Every function and class takes `group`: the process group of the tensor-parallel ranks, None meaning
the default (world) group. Use only that group: pass it to every collective, and take this rank's index r and
the number of ranks N from `dist.get_rank(group)` and `dist.get_world_size(group)`.

Layout: activations are [B, T, D] (batch, sequence, features), the sequence is dimension 1. In the
sequence-parallel regions rank r holds tokens r*T/N..(r+1)*T/N of every sequence, [B, T/N, D], written
x_local_BtD (t = T/N); T must be divisible by N, every rank holds the same number of tokens.

This module is self-contained: write its column- and row-parallel pieces here (do not import other problems).
Do not use torch.distributed.tensor (DTensor, parallelize_module) or torch.distributed.nn.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # the collectives you will need live here
from torch import Tensor


def gather_sequence(x_local_BtD: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """All-gather along the sequence: [B, t, D] on each rank -> [B, N*t, D], the ranks' shards in rank order.

    Forward: exactly one all-gather (`dist.all_gather_into_tensor` or `dist.all_gather`). Backward (write it as a
    torch.autograd.Function): every rank's [B, T, D] gradient is a partial sum; rank r's input gradient is the sum
    over ranks of their gradients' tokens r*t..(r+1)*t, computed with exactly one reduce-scatter
    (`dist.reduce_scatter_tensor` or `dist.reduce_scatter`). No all-reduce. ValueError if x_local_BtD is not 3-D.
    The argument is not modified.
    """
    raise NotImplementedError


def reduce_scatter_sequence(x_BTD: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Reduce-scatter along the sequence: [B, T, D] partial sums on each rank -> [B, T/N, D] on rank r, the sum over
    ranks of their tokens r*T/N..(r+1)*T/N.

    Forward: exactly one reduce-scatter (`dist.reduce_scatter_tensor` or `dist.reduce_scatter`), never an all-reduce
    (each rank receives only its shard of the sum). Backward (an autograd.Function): the [B, T/N, D] gradients of
    all ranks are all-gathered along the sequence into the [B, T, D] input gradient, with exactly one all-gather.
    ValueError if x_BTD is not 3-D or T % N != 0. The argument is not modified.
    """
    raise NotImplementedError


class SequenceParallelMLPBlock(torch.nn.Module):
    """y = x + dropout(fc2(gelu(fc1(norm(x))))), tensor-parallel in the MLP and sequence-parallel elsewhere.

    The single-rank block it reproduces, for x [B, T, D]: norm is `norm` (a torch.nn.LayerNorm over D, its eps, with
    or without weight and bias), fc1: Linear(D, F), fc2: Linear(F, D) (each with or without bias), gelu the exact
    (erf) form, dropout as pinned below.

    Per rank, on x_local_BtD [B, t, D] (this rank's tokens):
      1. norm on the local tokens (LayerNorm acts token by token; no communication);
      2. gather_sequence -> [B, T, D];
      3. fc1 column-parallel: this rank's hidden features r*F/N..(r+1)*F/N, then gelu -> [B, T, F/N];
      4. fc2 row-parallel partial products (without bias) -> [B, T, D], then reduce_scatter_sequence -> [B, t, D];
      5. + fc2's bias (once, on the reduced shard), dropout on the local shard, + x_local_BtD (the residual).
    Returns [B, t, D], this rank's tokens of y.

    Dropout, pinned so that results are comparable with the single-rank block: with p = dropout_p > 0, the mask of
    the FULL [B, T, D] activation is
        keep = torch.rand((B, T, D), generator=torch.Generator().manual_seed(seed), dtype=torch.float32) >= p
    (a CPU generator, then moved to the activation's device), rank r uses keep[:, r*t:(r+1)*t], and dropout(z) =
    z * keep / (1 - p). With p == 0 dropout is the identity. It is applied in every call (there is no eval mode).

    Parameters (registered exactly under these names, each an nn.Parameter that requires grad; the grader reads
    `named_parameters()`): `norm.weight`, `norm.bias` [D] (replicated; absent when `norm` lacks them),
    `fc1.weight` [F/N, D] = fc1.weight[r*F/N:(r+1)*F/N], `fc1.bias` [F/N] (same rows), `fc2.weight` [D, F/N] =
    fc2.weight[:, r*F/N:(r+1)*F/N], `fc2.bias` [D] (replicated). Absent biases are not registered.
    ValueError if F % N != 0 or dropout_p is not in [0, 1).

    Communication, exactly, per forward: one all-gather of [B, T, D] then one reduce-scatter to [B, t, D]; per
    backward: one all-gather of [B, T, D] and one reduce-scatter to [B, t, D]. No all-reduce in forward or backward.
    """

    def __init__(
        self,
        norm: torch.nn.LayerNorm,
        fc1: torch.nn.Linear,
        fc2: torch.nn.Linear,
        dropout_p: float,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """Copy the replicated norm, keep rank r's shards of fc1 (rows) and fc2 (columns) and fc2's whole bias."""
        raise NotImplementedError

    def forward(self, x_local_BtD: Tensor, seed: int = 0) -> Tensor:
        """[B, t, D] -> [B, t, D]: the block on this rank's tokens; `seed` seeds the dropout mask (see above)."""
        raise NotImplementedError

    def all_reduce_replicated_gradients(self) -> None:
        """Called by the user after backward, before the optimizer step: sum, over the ranks of `group`, the gradients
        of the replicated parameters that see only this rank's tokens (norm.weight, norm.bias and fc2.bias, those
        that exist), in place in their `.grad`, with all-reduces (one per tensor or one for all of them together).
        Afterwards every rank holds in each the full single-rank gradient. fc1's and fc2.weight's gradients are
        already complete (each rank's shard saw every token after the gather) and are not touched.
        """
        raise NotImplementedError
