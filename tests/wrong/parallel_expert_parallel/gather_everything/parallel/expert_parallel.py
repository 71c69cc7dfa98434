"""Wrong on purpose: every rank all-gathers every token with its routing, applies its own experts to the tokens
routed to them, and an all-reduce sums the partial outputs of all ranks. The results are right, but each rank
receives all tokens and all outputs instead of only the rows routed to it, and no all_to_all is used."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class GatherRows(torch.autograd.Function):
    """Each rank's [rows, ...] (padded to the same length) concatenated over ranks; backward sums the gradients and
    keeps this rank's block."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * ctx.rows:(rank + 1) * ctx.rows], None


class SumToOwner(torch.autograd.Function):
    """Sum of every rank's partial [N * rows, D] output, of which this rank keeps its own block."""

    @staticmethod
    def forward(ctx, partial, rows, group):
        ctx.group, ctx.rows = group, rows
        total = partial.clone()
        dist.all_reduce(total, group=group)
        rank = dist.get_rank(group)
        return total[rank * rows:(rank + 1) * rows]

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None, None


def expert_parallel_moe(x_TD, expert_index_TK, gate_TK, w_in_EDH, w_out_EHD, num_experts, group=None):
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_experts % n:
        raise ValueError("experts must split evenly over ranks")
    per_rank = num_experts // n
    if w_in_EDH.shape[0] != per_rank or w_out_EHD.shape[0] != per_rank:
        raise ValueError("wrong number of local experts")
    T, k = expert_index_TK.shape
    sizes = [torch.zeros(1, dtype=torch.int64, device=x_TD.device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([T], device=x_TD.device), group=group)
    padded = int(max(s.item() for s in sizes))

    def pad(t, value=0):
        return torch.cat([t, t.new_full((padded - T, *t.shape[1:]), value)])

    x_all = GatherRows.apply(pad(x_TD), group)
    gate_all = GatherRows.apply(pad(gate_TK), group)
    index_all = torch.cat([torch.empty_like(pad(expert_index_TK, -1)) for _ in range(n)])
    dist.all_gather(list(index_all.chunk(n)), pad(expert_index_TK, -1), group=group)

    partial = torch.zeros_like(x_all)
    for e in range(per_rank):
        token, slot = (index_all == rank * per_rank + e).nonzero(as_tuple=True)
        out = F.silu(x_all[token] @ w_in_EDH[e]) @ w_out_EHD[e]
        partial = partial.index_add(0, token, out * gate_all[token, slot].unsqueeze(1))
    return SumToOwner.apply(partial, padded, group)[:T]
