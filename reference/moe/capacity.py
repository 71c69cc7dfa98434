"""Expert capacity and token dropping for top-k token-choice routing.

`apply_capacity` is the fast reference; `apply_capacity_torch` walks the assignments one by one in priority order.
The contract (capacity rounding, slot-major priority, outputs, errors) is the docstring of the student stub.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class CapacityOutput(NamedTuple):
    capacity: int  # slots per expert
    kept_TK: Tensor  # bool [T, k]
    position_TK: Tensor  # int64 [T, k]
    gate_TK: Tensor  # dtype of the input gates, [T, k]
    tokens_per_expert_E: Tensor  # int64 [E]


def _check_arguments(expert_index_TK: Tensor, gate_TK: Tensor, num_experts: int, capacity_factor: float) -> None:
    if expert_index_TK.dtype != torch.int64:
        raise TypeError(f"expert_index_TK must be int64, got {expert_index_TK.dtype}")
    if not gate_TK.is_floating_point():
        raise TypeError(f"gate_TK must have a floating dtype, got {gate_TK.dtype}")
    if expert_index_TK.dim() != 2 or gate_TK.dim() != 2:
        raise ValueError(f"expert_index_TK and gate_TK must be 2-D [T, k], got shapes "
                         f"{tuple(expert_index_TK.shape)} and {tuple(gate_TK.shape)}")
    if expert_index_TK.shape != gate_TK.shape:
        raise ValueError(f"expert_index_TK has shape {tuple(expert_index_TK.shape)} but gate_TK has "
                         f"{tuple(gate_TK.shape)}")
    if expert_index_TK.numel() == 0:
        raise ValueError(f"no assignments (T or k is 0): shape {tuple(expert_index_TK.shape)}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be at least 1, got {num_experts}")
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    if int(expert_index_TK.min()) < 0 or int(expert_index_TK.max()) >= num_experts:
        raise ValueError(f"expert indices must lie in [0, {num_experts})")
    sorted_TK = expert_index_TK.sort(dim=1).values
    if bool((sorted_TK[:, 1:] == sorted_TK[:, :-1]).any()):
        raise ValueError("a token lists the same expert more than once")


def _expert_capacity(num_tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
    return math.ceil(capacity_factor * num_tokens * k / num_experts)


def apply_capacity(expert_index_TK: Tensor, gate_TK: Tensor, num_experts: int,
                   capacity_factor: float) -> CapacityOutput:
    """Keep the first `capacity` assignments of each expert in slot-major order. See the stub's docstring."""
    _check_arguments(expert_index_TK, gate_TK, num_experts, capacity_factor)
    num_tokens, k = expert_index_TK.shape
    capacity = _expert_capacity(num_tokens, k, num_experts, capacity_factor)

    # Slot-major order is the row-major order of the transposed [k, T] index matrix. A stable sort by expert keeps
    # that order within each expert, so an assignment's buffer position is its rank inside its expert's run.
    expert_N = expert_index_TK.T.reshape(-1)
    order_N = torch.argsort(expert_N, stable=True)
    assignments_E = torch.zeros(num_experts, dtype=torch.int64, device=expert_N.device)
    assignments_E.scatter_add_(0, expert_N, torch.ones_like(expert_N))
    run_start_E = torch.cumsum(assignments_E, dim=0) - assignments_E
    rank_in_run_N = torch.arange(expert_N.numel(), device=expert_N.device) - run_start_E[expert_N[order_N]]
    position_N = torch.empty_like(expert_N)
    position_N[order_N] = rank_in_run_N
    position_TK = position_N.view(k, num_tokens).T

    kept_TK = position_TK < capacity
    position_TK = torch.where(kept_TK, position_TK, -1)
    # where, not a product with the mask: a dropped gate becomes exactly 0 even if it was inf or NaN.
    kept_gate_TK = torch.where(kept_TK, gate_TK, torch.zeros((), dtype=gate_TK.dtype, device=gate_TK.device))
    tokens_per_expert_E = assignments_E.clamp(max=capacity)
    return CapacityOutput(capacity, kept_TK, position_TK.contiguous(), kept_gate_TK, tokens_per_expert_E)


def apply_capacity_torch(expert_index_TK: Tensor, gate_TK: Tensor, num_experts: int,
                         capacity_factor: float) -> CapacityOutput:
    """The same dropping as `apply_capacity`, one assignment at a time in priority order."""
    _check_arguments(expert_index_TK, gate_TK, num_experts, capacity_factor)
    num_tokens, k = expert_index_TK.shape
    capacity = _expert_capacity(num_tokens, k, num_experts, capacity_factor)
    experts = expert_index_TK.tolist()
    filled = [0] * num_experts
    position = [[-1] * k for _ in range(num_tokens)]
    for slot in range(k):
        for token in range(num_tokens):
            expert = experts[token][slot]
            if filled[expert] < capacity:
                position[token][slot] = filled[expert]
                filled[expert] += 1
    position_TK = torch.tensor(position, dtype=torch.int64, device=expert_index_TK.device)
    kept_TK = position_TK >= 0
    kept_gate_TK = gate_TK * kept_TK.to(gate_TK.dtype)
    tokens_per_expert_E = torch.tensor(filled, dtype=torch.int64, device=expert_index_TK.device)
    return CapacityOutput(capacity, kept_TK, position_TK, kept_gate_TK, tokens_per_expert_E)
