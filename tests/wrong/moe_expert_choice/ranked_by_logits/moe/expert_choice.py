"""Expert-choice routing: each expert chooses its top-c tokens.

Wrong on purpose: each expert ranks the tokens by their raw logits instead of their probabilities.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class ExpertChoiceOutput(NamedTuple):
    token_index_EC: Tensor  # int64 [E, C]
    gate_EC: Tensor  # float32 [E, C]
    experts_per_token_T: Tensor  # int64 [T]


def _check_arguments(x_TD: Tensor, router_weight_ED: Tensor, capacity_factor: float) -> None:
    for name, tensor in (("x_TD", x_TD), ("router_weight_ED", router_weight_ED)):
        if not tensor.is_floating_point():
            raise TypeError(f"{name} must have a floating dtype, got {tensor.dtype}")
    if x_TD.dim() != 2 or router_weight_ED.dim() != 2:
        raise ValueError(f"x_TD and router_weight_ED must be 2-D, got shapes {tuple(x_TD.shape)} and "
                         f"{tuple(router_weight_ED.shape)}")
    if x_TD.shape[1] != router_weight_ED.shape[1]:
        raise ValueError(f"x_TD has D={x_TD.shape[1]} but router_weight_ED has D={router_weight_ED.shape[1]}")
    if x_TD.shape[0] == 0 or router_weight_ED.shape[0] == 0:
        raise ValueError(f"no tokens or no experts: T={x_TD.shape[0]}, E={router_weight_ED.shape[0]}")
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")


def _tokens_per_expert(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    return min(num_tokens, max(1, math.floor(capacity_factor * num_tokens / num_experts)))


def _topk_ties_to_lowest_index(probs_ET: Tensor, c: int) -> Tensor:
    """Indices of the c largest entries of each row, ordered by (value descending, index ascending).

    Non-negative float32 values order like their bit patterns read as integers. Packing each probability's bits
    above T - 1 - token makes every key distinct and its integer order exactly the pinned order, so one top-k over
    the keys is exact without sorting whole rows.
    """
    num_tokens = probs_ET.shape[-1]
    value_bits_ET = probs_ET.detach().contiguous().view(torch.int32).to(torch.int64)
    rank_T = torch.arange(num_tokens - 1, -1, -1, device=probs_ET.device)
    return ((value_bits_ET << 32) | rank_T).topk(c, dim=-1).indices


def expert_choice_route(x_TD: Tensor, router_weight_ED: Tensor, capacity_factor: float) -> ExpertChoiceOutput:
    """Each expert takes its C most probable tokens, all in float32."""
    _check_arguments(x_TD, router_weight_ED, capacity_factor)
    num_tokens, num_experts = x_TD.shape[0], router_weight_ED.shape[0]
    c = _tokens_per_expert(num_tokens, num_experts, capacity_factor)

    logits_TE = x_TD.float() @ router_weight_ED.float().T
    probs_ET = torch.softmax(logits_TE, dim=-1).T
    token_index_EC = torch.sort(logits_TE.T, dim=1, descending=True, stable=True).indices[:, :c]
    gate_EC = probs_ET.gather(1, token_index_EC)

    # scatter_add_ rather than bincount: bincount reads the largest index back to the host to size its output.
    chosen = token_index_EC.flatten()
    experts_per_token_T = torch.zeros(num_tokens, dtype=torch.int64, device=x_TD.device)
    experts_per_token_T.scatter_add_(0, chosen, torch.ones_like(chosen))
    return ExpertChoiceOutput(token_index_EC, gate_EC, experts_per_token_T)

