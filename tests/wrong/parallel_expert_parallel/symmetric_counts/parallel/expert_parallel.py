"""Wrong on purpose: no counts are exchanged: each rank assumes every peer sends it as many rows for
each expert as it sends to that peer, which holds only when routing is the same on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), x.shape[1]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.in_splits), grad.shape[1]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


def expert_parallel_moe(x_TD, expert_index_TK, gate_TK, w_in_EDH, w_out_EHD, num_experts, group=None):
    n = dist.get_world_size(group)
    if num_experts % n:
        raise ValueError("experts must split evenly over ranks")
    per_rank = num_experts // n
    if w_in_EDH.shape[0] != per_rank or w_out_EHD.shape[0] != per_rank:
        raise ValueError("wrong number of local experts")
    k = expert_index_TK.shape[1]
    flat = expert_index_TK.flatten()
    order = flat.argsort(stable=True)
    tokens = order // k
    send_rows = x_TD[tokens]
    counts = torch.bincount(flat, minlength=num_experts)
    # Routing is balanced, so what a peer sends me mirrors what I send it.
    recv_counts = counts.clone()
    send_splits = counts.view(n, per_rank).sum(1).tolist()
    recv_splits = recv_counts.view(n, per_rank).sum(1).tolist()
    received = AllToAll.apply(send_rows, recv_splits, send_splits, group)

    # The received rows come grouped by source rank, then by local expert; regroup them by expert.
    expert_of_row = torch.arange(per_rank, device=x_TD.device).repeat(n).repeat_interleave(recv_counts)
    regroup = expert_of_row.argsort(stable=True)
    grouped = received[regroup]
    outputs = []
    start = 0
    for e, count in enumerate(recv_counts.view(n, per_rank).sum(0).tolist()):
        rows = grouped[start:start + count]
        outputs.append(F.silu(rows @ w_in_EDH[e]) @ w_out_EHD[e])
        start += count
    expert_out = torch.cat(outputs)
    ungrouped = torch.empty_like(expert_out).index_copy(0, regroup, expert_out)

    back = AllToAll.apply(ungrouped, send_splits, recv_splits, group)
    gates = gate_TK.flatten()[order].unsqueeze(1)
    return torch.zeros_like(x_TD).index_add(0, tokens, back * gates)
