"""Auxiliary-loss-free load balancing: after a step, nudge each expert's selection bias against its load.

Every output is exact (integer loads, one float32 addition per bias), so the grader compares them with the
reference's bit for bit and needs no separate float64 version. The contract is the docstring of the student stub.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class BiasUpdate(NamedTuple):
    tokens_per_expert_E: Tensor  # int64 [E]
    expert_bias_E: Tensor  # float32 [E]


def _check_arguments(scores_TE: Tensor, expert_bias_E: Tensor, k: int, update_rate: float) -> None:
    for name, tensor in (("scores_TE", scores_TE), ("expert_bias_E", expert_bias_E)):
        if not tensor.is_floating_point():
            raise TypeError(f"{name} must have a floating dtype, got {tensor.dtype}")
    if scores_TE.dim() != 2:
        raise ValueError(f"scores_TE must be 2-D [T, E], got shape {tuple(scores_TE.shape)}")
    if scores_TE.shape[0] == 0:
        raise ValueError("scores_TE has no tokens (T == 0)")
    num_experts = scores_TE.shape[1]
    if tuple(expert_bias_E.shape) != (num_experts,):
        raise ValueError(f"expert_bias_E must have shape ({num_experts},), got {tuple(expert_bias_E.shape)}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must be in [1, E={num_experts}], got {k}")
    if not (math.isfinite(update_rate) and update_rate >= 0):
        raise ValueError(f"update_rate must be finite and >= 0, got {update_rate}")


def _topk_ties_to_lowest_index(scores_TE: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries of each row of a float32 tensor, ties to the lower index.

    Each score is packed with its expert's rank into one int64 key whose integer order is (score, lower index
    first), so top-k over the (all distinct) keys is exact. Read as int32, non-negative floats order like their
    bits; flipping the 31 low bits of negative ones makes all of them do so (adding 0.0 first turns -0.0, which
    equals 0.0, into 0.0). The low 32 bits hold E - 1 - expert.
    """
    num_experts = scores_TE.shape[-1]
    bits_TE = (scores_TE + 0.0).view(torch.int32)
    ordered_bits_TE = torch.where(bits_TE < 0, bits_TE ^ 0x7FFFFFFF, bits_TE).to(torch.int64)
    rank_E = torch.arange(num_experts - 1, -1, -1, device=scores_TE.device)
    return ((ordered_bits_TE << 32) | rank_E).topk(k, dim=-1).indices


@torch.no_grad()
def update_expert_bias(scores_TE: Tensor, expert_bias_E: Tensor, k: int, update_rate: float) -> BiasUpdate:
    """Loads under biased top-k selection, and the sign update of the bias against them.

    See the stub's docstring for the full contract.
    """
    _check_arguments(scores_TE, expert_bias_E, k, update_rate)
    num_tokens, num_experts = scores_TE.shape
    bias_E = expert_bias_E.float()
    chosen_TK = _topk_ties_to_lowest_index(scores_TE.float() + bias_E, k)

    # scatter_add_ rather than bincount: bincount reads the largest index back to the host to size its output.
    assigned = chosen_TK.flatten()
    load_E = torch.zeros(num_experts, dtype=torch.int64, device=scores_TE.device)
    load_E.scatter_add_(0, assigned, torch.ones_like(assigned))

    # load_i < T k / E  <=>  E load_i < T k, in exact integers: +1 below the mean, -1 above, 0 at it.
    direction_E = torch.sign(num_tokens * k - num_experts * load_E).float()
    return BiasUpdate(load_E, bias_E + direction_E * update_rate)
