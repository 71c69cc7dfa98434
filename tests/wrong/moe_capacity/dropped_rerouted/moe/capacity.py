"""Expert capacity and token dropping.

Wrong on purpose: an assignment that finds its expert full is moved to the expert with the most free slots (if it
is not already one of the token's experts) instead of being dropped.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class CapacityOutput(NamedTuple):
    capacity: int
    kept_TK: Tensor
    position_TK: Tensor
    gate_TK: Tensor
    tokens_per_expert_E: Tensor


def _check(expert_index_TK: Tensor, gate_TK: Tensor, num_experts: int, capacity_factor: float) -> None:
    if expert_index_TK.dtype != torch.int64 or not gate_TK.is_floating_point():
        raise TypeError("expert_index_TK must be int64 and gate_TK floating")
    if expert_index_TK.dim() != 2 or expert_index_TK.shape != gate_TK.shape or expert_index_TK.numel() == 0:
        raise ValueError("expert_index_TK and gate_TK must have the same non-empty 2-D shape")
    if num_experts < 1 or capacity_factor <= 0:
        raise ValueError("num_experts and capacity_factor must be positive")
    if expert_index_TK.min() < 0 or expert_index_TK.max() >= num_experts:
        raise ValueError("expert index out of range")
    sorted_TK = expert_index_TK.sort(dim=1).values
    if (sorted_TK[:, 1:] == sorted_TK[:, :-1]).any():
        raise ValueError("a token lists an expert twice")


def apply_capacity(expert_index_TK: Tensor, gate_TK: Tensor, num_experts: int,
                   capacity_factor: float) -> CapacityOutput:
    _check(expert_index_TK, gate_TK, num_experts, capacity_factor)
    num_tokens, k = expert_index_TK.shape
    capacity = math.ceil(capacity_factor * num_tokens * k / num_experts)
    experts = expert_index_TK.tolist()
    filled = [0] * num_experts
    position = [[-1] * k for _ in range(num_tokens)]
    for slot in range(k):
        for token in range(num_tokens):
            expert = experts[token][slot]
            if filled[expert] >= capacity:
                emptiest = min(range(num_experts), key=lambda e: filled[e])
                if filled[emptiest] < capacity and emptiest not in experts[token]:
                    expert = emptiest
            if filled[expert] < capacity:
                position[token][slot] = filled[expert]
                filled[expert] += 1
    position_TK = torch.tensor(position, device=expert_index_TK.device)
    kept_TK = position_TK >= 0
    return CapacityOutput(
        capacity, kept_TK, position_TK, torch.where(kept_TK, gate_TK, torch.zeros_like(gate_TK)),
        torch.tensor(filled, device=expert_index_TK.device),
    )
