"""DeepSeek-V3 style routing: sigmoid affinities, a per-expert bias that steers the selection only, and gates taken
from the unbiased affinities.

Wrong on purpose: the affinities are a softmax over the experts instead of an elementwise sigmoid.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class SigmoidRouterOutput(NamedTuple):
    expert_index_TK: Tensor
    gate_TK: Tensor
    tokens_per_expert_E: Tensor


def sigmoid_route(
    x_TD: Tensor, router_weight_ED: Tensor, expert_bias_E: Tensor, k: int, route_scale: float = 1.0
) -> SigmoidRouterOutput:
    for tensor in (x_TD, router_weight_ED, expert_bias_E):
        if not tensor.is_floating_point():
            raise TypeError("x_TD, router_weight_ED and expert_bias_E must have floating dtypes")
    if x_TD.dim() != 2 or router_weight_ED.dim() != 2:
        raise ValueError("x_TD and router_weight_ED must both be 2-D")
    if x_TD.shape[1] != router_weight_ED.shape[1] or x_TD.shape[0] == 0:
        raise ValueError("x_TD and router_weight_ED have different widths D, or there are no tokens")
    num_experts = router_weight_ED.shape[0]
    if expert_bias_E.shape != (num_experts,) or not 1 <= k <= num_experts:
        raise ValueError("expert_bias_E must have one entry per expert, and k must be in [1, E]")
    if not (math.isfinite(route_scale) and route_scale > 0):
        raise ValueError("route_scale must be positive and finite")

    affinity = torch.softmax(x_TD.float() @ router_weight_ED.float().T, dim=-1)
    selection = affinity + expert_bias_E.float()
    expert_index = torch.sort(selection, dim=-1, descending=True, stable=True).indices[:, :k]
    chosen = affinity.gather(1, expert_index)
    gates = route_scale * chosen / chosen.sum(dim=-1, keepdim=True)
    counts = torch.bincount(expert_index.flatten(), minlength=num_experts)
    return SigmoidRouterOutput(expert_index, gates, counts)
