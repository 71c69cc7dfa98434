"""Expert capacity and token dropping.

Wrong on purpose: experts fill their buffers in token order (token 0's slots, then token 1's, ...) instead of
slot-major order (all first choices before any second choice).
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
    expert_N = expert_index_TK.reshape(-1)
    one_hot_NE = torch.nn.functional.one_hot(expert_N, num_experts)
    position_N = ((one_hot_NE.cumsum(dim=0) - 1) * one_hot_NE).sum(dim=1)
    position_TK = position_N.view(num_tokens, k)
    kept_TK = position_TK < capacity
    return CapacityOutput(
        capacity, kept_TK, torch.where(kept_TK, position_TK, -1),
        torch.where(kept_TK, gate_TK, torch.zeros_like(gate_TK)),
        (one_hot_NE.sum(dim=0)).clamp(max=capacity),
    )
