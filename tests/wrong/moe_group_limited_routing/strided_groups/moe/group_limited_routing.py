"""Group-limited (device- or node-limited) routing: each token first picks a few groups of experts, then its
experts only within them.

Wrong on purpose: expert e is placed in group e % G (strided) instead of the contiguous group e // S.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class GroupRoutingOutput(NamedTuple):
    group_index_TM: Tensor
    expert_index_TK: Tensor
    gate_TK: Tensor


def group_limited_route(
    x_TD: Tensor,
    router_weight_ED: Tensor,
    num_groups: int,
    groups_per_token: int,
    k: int,
    route_scale: float = 1.0,
) -> GroupRoutingOutput:
    if not x_TD.is_floating_point() or not router_weight_ED.is_floating_point():
        raise TypeError("x_TD and router_weight_ED must have floating dtypes")
    if x_TD.dim() != 2 or router_weight_ED.dim() != 2:
        raise ValueError("x_TD and router_weight_ED must both be 2-D")
    if x_TD.shape[1] != router_weight_ED.shape[1] or x_TD.shape[0] == 0:
        raise ValueError("x_TD and router_weight_ED have different widths D, or there are no tokens")
    num_tokens, num_experts = x_TD.shape[0], router_weight_ED.shape[0]
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError("num_groups must divide the number of experts")
    group_size = num_experts // num_groups
    if not 1 <= groups_per_token <= num_groups or not 1 <= k <= groups_per_token * group_size:
        raise ValueError("groups_per_token must be in [1, G] and k in [1, M * E / G]")
    if not (math.isfinite(route_scale) and route_scale > 0):
        raise ValueError("route_scale must be positive and finite")

    affinity = torch.sigmoid(x_TD.float() @ router_weight_ED.float().T)
    grouped = affinity.view(num_tokens, group_size, num_groups).transpose(1, 2)
    top_two = grouped.sort(dim=-1, descending=True).values[..., :2]
    group_score = top_two.sum(dim=-1)
    group_index = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :groups_per_token]
    kept = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=x_TD.device)
    kept.scatter_(1, group_index, True)
    eligible = kept.repeat(1, group_size)
    masked = affinity.masked_fill(~eligible, -math.inf)
    expert_index = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
    chosen = affinity.gather(1, expert_index)
    gates = route_scale * chosen / chosen.sum(dim=-1, keepdim=True)
    return GroupRoutingOutput(group_index, expert_index, gates)
