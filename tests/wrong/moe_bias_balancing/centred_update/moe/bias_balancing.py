"""Auxiliary-loss-free load balancing: after a step, nudge each expert's selection bias against its load.

Wrong on purpose: the mean of the steps is subtracted, so the biases keep their sum.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class BiasUpdate(NamedTuple):
    tokens_per_expert_E: Tensor
    expert_bias_E: Tensor


def update_expert_bias(scores_TE: Tensor, expert_bias_E: Tensor, k: int, update_rate: float) -> BiasUpdate:
    if not scores_TE.is_floating_point() or not expert_bias_E.is_floating_point():
        raise TypeError("scores_TE and expert_bias_E must have floating dtypes")
    if scores_TE.dim() != 2 or scores_TE.shape[0] == 0:
        raise ValueError("scores_TE must be 2-D with at least one token")
    num_tokens, num_experts = scores_TE.shape
    if expert_bias_E.shape != (num_experts,) or not 1 <= k <= num_experts:
        raise ValueError("expert_bias_E must have one entry per expert, and k must be in [1, E]")
    if not (math.isfinite(update_rate) and update_rate >= 0):
        raise ValueError("update_rate must be finite and >= 0")

    bias = expert_bias_E.float()
    selection = scores_TE.float() + bias
    chosen = torch.sort(selection, dim=-1, descending=True, stable=True).indices[:, :k]
    load = torch.bincount(chosen.flatten(), minlength=num_experts)
    mean_load = num_tokens * k / num_experts
    step = -update_rate * torch.sign(load - mean_load).float()
    new_bias = bias + (step - step.mean())
    return BiasUpdate(load, new_bias)
