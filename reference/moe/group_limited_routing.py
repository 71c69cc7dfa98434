"""Group-limited (device- or node-limited) routing: each token first picks a few groups of experts, then its
experts only within them.

`group_limited_route` is the fast reference; `group_limited_route_torch` writes the same math as plainly as
possible. The contract (shapes, dtypes, group scores, tie-breaking, errors) is the docstring of the student stub of
this module.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class GroupRoutingOutput(NamedTuple):
    group_index_TM: Tensor  # int64 [T, M]
    expert_index_TK: Tensor  # int64 [T, k]
    gate_TK: Tensor  # float32 [T, k]


def _check_arguments(x_TD: Tensor, router_weight_ED: Tensor, num_groups: int, groups_per_token: int, k: int,
                     route_scale: float) -> None:
    for name, tensor in (("x_TD", x_TD), ("router_weight_ED", router_weight_ED)):
        if not tensor.is_floating_point():
            raise TypeError(f"{name} must have a floating dtype, got {tensor.dtype}")
    if x_TD.dim() != 2:
        raise ValueError(f"x_TD must be 2-D [T, D], got shape {tuple(x_TD.shape)}")
    if router_weight_ED.dim() != 2:
        raise ValueError(f"router_weight_ED must be 2-D [E, D], got shape {tuple(router_weight_ED.shape)}")
    if x_TD.shape[1] != router_weight_ED.shape[1]:
        raise ValueError(f"x_TD has D={x_TD.shape[1]} but router_weight_ED has D={router_weight_ED.shape[1]}")
    if x_TD.shape[0] == 0:
        raise ValueError("x_TD has no tokens (T == 0)")
    num_experts = router_weight_ED.shape[0]
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_groups must be a positive divisor of E={num_experts}, got {num_groups}")
    if not 1 <= groups_per_token <= num_groups:
        raise ValueError(f"groups_per_token must be in [1, num_groups={num_groups}], got {groups_per_token}")
    reachable = groups_per_token * (num_experts // num_groups)
    if not 1 <= k <= reachable:
        raise ValueError(f"k must be in [1, groups_per_token * E / num_groups = {reachable}], got {k}")
    if not (math.isfinite(route_scale) and route_scale > 0):
        raise ValueError(f"route_scale must be positive and finite, got {route_scale}")


def _topk_ties_to_lowest_index(scores_TN: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries of each row of a float32 tensor, ordered by (value descending, index
    ascending).

    Each score is packed with its index's rank into one int64 key whose integer order is exactly that order, so
    top-k over the (all distinct) keys is exact and its order unique. Read as int32, non-negative floats order
    like their bits; flipping the 31 low bits of negative ones (here -inf, the excluded experts) makes all of them
    do so. The low 32 bits hold N - 1 - index, so among equal scores the lower index has the larger key.
    """
    size = scores_TN.shape[-1]
    bits_TN = (scores_TN.detach() + 0.0).view(torch.int32)
    ordered_bits_TN = torch.where(bits_TN < 0, bits_TN ^ 0x7FFFFFFF, bits_TN).to(torch.int64)
    rank_N = torch.arange(size - 1, -1, -1, device=scores_TN.device)
    return ((ordered_bits_TN << 32) | rank_N).topk(k, dim=-1).indices


def group_limited_route(
    x_TD: Tensor,
    router_weight_ED: Tensor,
    num_groups: int,
    groups_per_token: int,
    k: int,
    route_scale: float = 1.0,
) -> GroupRoutingOutput:
    """Route each token to k experts within its `groups_per_token` best groups, gated by renormalised affinities.

    See the stub's docstring for the full contract.
    """
    _check_arguments(x_TD, router_weight_ED, num_groups, groups_per_token, k, route_scale)
    num_tokens, num_experts = x_TD.shape[0], router_weight_ED.shape[0]
    group_size = num_experts // num_groups

    affinity_TE = torch.sigmoid(x_TD.float() @ router_weight_ED.float().T)
    # Contiguous groups: a view, no copy.
    affinity_TGS = affinity_TE.detach().view(num_tokens, num_groups, group_size)
    if group_size == 1:
        group_score_TG = affinity_TGS[..., 0]
    else:
        group_score_TG = affinity_TGS.topk(2, dim=-1).values.sum(dim=-1)
    group_index_TM = _topk_ties_to_lowest_index(group_score_TG, groups_per_token)

    kept_TG = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=x_TD.device)
    kept_TG.scatter_(1, group_index_TM, True)
    eligible_TE = affinity_TGS.masked_fill(~kept_TG[..., None], -math.inf).view(num_tokens, num_experts)
    expert_index_TK = _topk_ties_to_lowest_index(eligible_TE, k)

    chosen_TK = affinity_TE.gather(1, expert_index_TK)
    # Folding route_scale into the divisor saves a pass over [T, k]; a sigmoid is positive, so the sum is too.
    gate_TK = chosen_TK / (chosen_TK.sum(dim=-1, keepdim=True) / route_scale)
    return GroupRoutingOutput(group_index_TM, expert_index_TK, gate_TK)


def group_limited_route_torch(
    x_TD: Tensor,
    router_weight_ED: Tensor,
    num_groups: int,
    groups_per_token: int,
    k: int,
    route_scale: float = 1.0,
) -> GroupRoutingOutput:
    """The same routing as `group_limited_route`, written as plainly as possible.

    One difference: it computes in float64 when either input is float64, and then returns its gates in float64.
    The grader evaluates it on float64 inputs to get the precise values that float32 computations are measured
    against.
    """
    _check_arguments(x_TD, router_weight_ED, num_groups, groups_per_token, k, route_scale)
    num_tokens, num_experts = x_TD.shape[0], router_weight_ED.shape[0]
    group_size = num_experts // num_groups
    uses_float64 = torch.float64 in (x_TD.dtype, router_weight_ED.dtype)
    compute_dtype = torch.float64 if uses_float64 else torch.float32

    affinity_TE = torch.sigmoid(x_TD.to(compute_dtype) @ router_weight_ED.to(compute_dtype).T)
    group_of_expert_E = torch.arange(num_experts, device=x_TD.device) // group_size
    group_score_TG = torch.empty(num_tokens, num_groups, dtype=compute_dtype, device=x_TD.device)
    for group in range(num_groups):
        in_group_TS = affinity_TE[:, group_of_expert_E == group]
        ranked_TS = in_group_TS.sort(dim=-1, descending=True).values
        group_score_TG[:, group] = ranked_TS[:, :2].sum(dim=-1)

    # Stable sorts keep equal scores in ascending index order.
    group_index_TM = torch.sort(group_score_TG, dim=-1, descending=True, stable=True).indices[:, :groups_per_token]
    eligible_TE = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=x_TD.device)
    for slot in range(groups_per_token):
        eligible_TE |= group_of_expert_E[None, :] == group_index_TM[:, slot : slot + 1]
    masked_TE = torch.where(eligible_TE, affinity_TE, torch.full_like(affinity_TE, -math.inf))
    expert_index_TK = torch.sort(masked_TE, dim=-1, descending=True, stable=True).indices[:, :k]

    chosen_TK = affinity_TE.gather(1, expert_index_TK)
    gate_TK = route_scale * chosen_TK / chosen_TK.sum(dim=-1, keepdim=True)
    return GroupRoutingOutput(group_index_TM, expert_index_TK, gate_TK)
