"""Top-k token-choice router for a mixture-of-experts layer, with its load-balancing and z losses.

Wrong on purpose: the chosen probabilities are returned as gates without rescaling them to sum to 1 when
normalize_topk is set.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class RouterOutput(NamedTuple):
    expert_index_TK: Tensor
    gate_TK: Tensor
    tokens_per_expert_E: Tensor
    balance_loss: Tensor
    z_loss: Tensor


def topk_route(x_TD: Tensor, router_weight_ED: Tensor, k: int, normalize_topk: bool = True) -> RouterOutput:
    if not x_TD.is_floating_point() or not router_weight_ED.is_floating_point():
        raise TypeError("x_TD and router_weight_ED must have floating dtypes")
    if x_TD.dim() != 2 or router_weight_ED.dim() != 2:
        raise ValueError("x_TD and router_weight_ED must both be 2-D")
    if x_TD.shape[1] != router_weight_ED.shape[1]:
        raise ValueError("x_TD and router_weight_ED have different widths D")
    num_tokens, num_experts = x_TD.shape[0], router_weight_ED.shape[0]
    if num_tokens == 0:
        raise ValueError("x_TD has no tokens")
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must be between 1 and {num_experts}, got {k}")

    logits_TE = x_TD.float() @ router_weight_ED.float().T
    probs_TE = torch.softmax(logits_TE, dim=-1)

    # A stable sort keeps the lower expert first among equal probabilities.
    order_TE = torch.sort(probs_TE.detach(), dim=-1, descending=True, stable=True).indices
    expert_index_TK = order_TE[:, :k]
    gate_TK = probs_TE.gather(1, expert_index_TK)

    tokens_per_expert_E = torch.bincount(expert_index_TK.flatten(), minlength=num_experts)
    f_E = tokens_per_expert_E.float() / (num_tokens * k)
    P_E = probs_TE.mean(dim=0)
    balance_loss = num_experts * (f_E * P_E).sum()
    z_loss = torch.logsumexp(logits_TE, dim=-1).pow(2).mean()

    return RouterOutput(expert_index_TK, gate_TK, tokens_per_expert_E, balance_loss, z_loss)
