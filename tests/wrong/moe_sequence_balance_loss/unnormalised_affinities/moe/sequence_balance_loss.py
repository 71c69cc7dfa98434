"""The sequence-wise auxiliary balance loss of DeepSeek-V3, for sigmoid-affinity routers.

Wrong on purpose: P_i is the mean of the sigmoid affinities themselves, not of the normalised ones.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_arguments(affinity_logits_BTE: Tensor, expert_index_BTK: Tensor, alpha: float) -> None:
    if not affinity_logits_BTE.is_floating_point():
        raise TypeError(f"affinity_logits_BTE must have a floating dtype, got {affinity_logits_BTE.dtype}")
    if expert_index_BTK.dtype != torch.int64:
        raise TypeError(f"expert_index_BTK must be int64, got {expert_index_BTK.dtype}")
    if affinity_logits_BTE.dim() != 3 or expert_index_BTK.dim() != 3:
        raise ValueError(f"both inputs must be 3-D, got shapes {tuple(affinity_logits_BTE.shape)} and "
                         f"{tuple(expert_index_BTK.shape)}")
    batch, tokens, experts = affinity_logits_BTE.shape
    if expert_index_BTK.shape[:2] != (batch, tokens):
        raise ValueError(f"affinity_logits_BTE has B, T = {batch}, {tokens} but expert_index_BTK has "
                         f"{tuple(expert_index_BTK.shape[:2])}")
    if batch == 0 or tokens == 0:
        raise ValueError(f"no tokens: B={batch}, T={tokens}")
    k = expert_index_BTK.shape[2]
    if not 1 <= k <= experts:
        raise ValueError(f"k must be in [1, E={experts}], got {k}")
    if int(expert_index_BTK.min()) < 0 or int(expert_index_BTK.max()) >= experts:
        raise ValueError(f"expert indices must lie in [0, {experts})")
    if not alpha >= 0:
        raise ValueError(f"alpha must be non-negative, got {alpha}")


def sequence_balance_loss(affinity_logits_BTE: Tensor, expert_index_BTK: Tensor, alpha: float) -> Tensor:
    """alpha * sum_i f_i P_i per sequence, averaged over the batch, in float32."""
    _check_arguments(affinity_logits_BTE, expert_index_BTK, alpha)
    batch, tokens, experts = affinity_logits_BTE.shape
    k = expert_index_BTK.shape[2]

    affinity_BTE = torch.sigmoid(affinity_logits_BTE.float())
    mean_affinity_BE = affinity_BTE.mean(dim=1)

    slots_BN = expert_index_BTK.reshape(batch, tokens * k)
    counts_BE = torch.zeros(batch, experts, dtype=torch.int64, device=slots_BN.device)
    counts_BE.scatter_add_(1, slots_BN, torch.ones_like(slots_BN))
    load_BE = counts_BE.float() * (experts / (k * tokens))

    return alpha * (load_BE * mean_affinity_BE).sum(dim=-1).mean()

