"""Expert parallelism: a mixture-of-experts layer whose experts are split across ranks, tokens dispatched to their
experts' ranks with all_to_all and the results combined back."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows, differentiable: the gradient goes back along the same routes, reversed."""

    @staticmethod
    def forward(ctx, rows: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        received = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        dist.all_to_all_single(received, rows.contiguous(), output_splits, input_splits, group=group)
        return received

    @staticmethod
    def backward(ctx, grad_received: Tensor):
        output_splits, input_splits = ctx.splits
        grad_rows = grad_received.new_empty((sum(input_splits), *grad_received.shape[1:]))
        dist.all_to_all_single(grad_rows, grad_received.contiguous(), input_splits, output_splits, group=ctx.group)
        return grad_rows, None, None, None


def _expert(x_TD: Tensor, w_in_DH: Tensor, w_out_HD: Tensor) -> Tensor:
    return torch.nn.functional.silu(x_TD @ w_in_DH) @ w_out_HD


def _inverse(permutation: Tensor) -> Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


def expert_parallel_moe(
    x_TD: Tensor,
    expert_index_TK: Tensor,
    gate_TK: Tensor,
    w_in_EDH: Tensor,
    w_out_EHD: Tensor,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_experts % ranks:
        raise ValueError(f"{num_experts} experts do not split evenly over {ranks} ranks")
    local_experts = num_experts // ranks
    if w_in_EDH.shape[0] != local_experts or w_out_EHD.shape[0] != local_experts:
        raise ValueError(f"rank {rank} must hold {local_experts} experts, got {w_in_EDH.shape[0]} and "
                         f"{w_out_EHD.shape[0]}")
    T, K = expert_index_TK.shape
    device = x_TD.device

    # Assignment a = t * K + j routes token t to expert_index_TK[t, j]. Sorting assignments by expert also sorts
    # them by destination rank, since rank r owns experts [r E/N, (r + 1) E/N).
    expert_A = expert_index_TK.reshape(-1)
    by_expert_A = torch.argsort(expert_A, stable=True)
    token_A = by_expert_A // K
    counts_E = torch.bincount(expert_A, minlength=num_experts)

    # Counts first: received_counts[s * E/N + e] = assignments of rank s to my local expert e (E int64 per rank).
    received_counts = torch.empty_like(counts_E)
    dist.all_to_all_single(received_counts, counts_E, group=group)
    send_splits = counts_E.view(ranks, local_experts).sum(1).tolist()
    receive_splits = received_counts.view(ranks, local_experts).sum(1).tolist()

    # Then the tokens: each rank receives only the rows routed to its own experts, grouped by source rank and,
    # within a source, by local expert.
    received_RD = _AllToAll.apply(x_TD[token_A], receive_splits, send_splits, group)
    local_expert_R = torch.repeat_interleave(
        torch.arange(local_experts, device=device).repeat(ranks), received_counts.to(device)
    )
    grouped_R = torch.argsort(local_expert_R, stable=True)
    rows_per_expert = received_counts.view(ranks, local_experts).sum(0).tolist()
    pieces = received_RD[grouped_R].split(rows_per_expert)
    expert_out_RD = torch.cat([_expert(rows, w_in_EDH[e], w_out_EHD[e]) for e, rows in enumerate(pieces)])

    # Back to source-major order, back to the source ranks (in the order they were sent), then each result is
    # weighted by its gate and added to its token.
    returned_AD = _AllToAll.apply(expert_out_RD[_inverse(grouped_R)], send_splits, receive_splits, group)
    gate_A = gate_TK.reshape(-1)[by_expert_A]
    weighted_AD = returned_AD * gate_A[:, None]
    return torch.zeros_like(x_TD).index_add(0, token_A, weighted_AD)


def expert_parallel_moe_torch(
    x_TD: Tensor, expert_index_TK: Tensor, gate_TK: Tensor, w_in_EDH: Tensor, w_out_EHD: Tensor
) -> Tensor:
    """The same layer on one rank holding every expert and every token."""
    y_TD = torch.zeros_like(x_TD)
    for e in range(w_in_EDH.shape[0]):
        token, slot = (expert_index_TK == e).nonzero(as_tuple=True)
        contribution = gate_TK[token, slot, None] * _expert(x_TD[token], w_in_EDH[e], w_out_EHD[e])
        y_TD = y_TD.index_add(0, token, contribution)
    return y_TD
