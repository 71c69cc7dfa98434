"""DeepSeek-V3 style routing: sigmoid affinities, a per-expert bias that steers the selection only, and gates taken
from the unbiased affinities.

`sigmoid_route` is the fast reference; `sigmoid_route_torch` writes the same math as plainly as possible. The
contract (shapes, dtypes, tie-breaking, errors) is the docstring of the student stub of this module.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class SigmoidRouterOutput(NamedTuple):
    expert_index_TK: Tensor  # int64 [T, k]
    gate_TK: Tensor  # float32 [T, k]
    tokens_per_expert_E: Tensor  # int64 [E]


def _check_arguments(x_TD: Tensor, router_weight_ED: Tensor, expert_bias_E: Tensor, k: int,
                     route_scale: float) -> None:
    for name, tensor in (("x_TD", x_TD), ("router_weight_ED", router_weight_ED), ("expert_bias_E", expert_bias_E)):
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
    if tuple(expert_bias_E.shape) != (num_experts,):
        raise ValueError(f"expert_bias_E must have shape ({num_experts},), got {tuple(expert_bias_E.shape)}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must be in [1, E={num_experts}], got {k}")
    if not (math.isfinite(route_scale) and route_scale > 0):
        raise ValueError(f"route_scale must be positive and finite, got {route_scale}")


def _topk_ties_to_lowest_index(scores_TE: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries of each row of a float32 tensor, ordered by (value descending, index
    ascending).

    Each score is packed with its expert's rank into one int64 key whose integer order is exactly that order, so
    top-k over the (all distinct) keys is exact and its order unique. Read as int32, non-negative floats order
    like their bits; flipping the 31 low bits of negative ones makes all of them do so (adding 0.0 first turns
    -0.0, which equals 0.0, into 0.0). The low 32 bits hold E - 1 - expert, so among equal scores the lower
    expert index has the larger key.
    """
    num_experts = scores_TE.shape[-1]
    bits_TE = (scores_TE.detach() + 0.0).view(torch.int32)
    ordered_bits_TE = torch.where(bits_TE < 0, bits_TE ^ 0x7FFFFFFF, bits_TE).to(torch.int64)
    rank_E = torch.arange(num_experts - 1, -1, -1, device=scores_TE.device)
    return ((ordered_bits_TE << 32) | rank_E).topk(k, dim=-1).indices


def _count_per_expert(expert_index_TK: Tensor, num_experts: int) -> Tensor:
    # scatter_add_ rather than bincount: bincount reads the largest index back to the host to size its output.
    assigned = expert_index_TK.flatten()
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=expert_index_TK.device)
    return counts_E.scatter_add_(0, assigned, torch.ones_like(assigned))


def sigmoid_route(
    x_TD: Tensor, router_weight_ED: Tensor, expert_bias_E: Tensor, k: int, route_scale: float = 1.0
) -> SigmoidRouterOutput:
    """Route each token to k experts chosen by sigmoid affinity plus bias, gated by the unbiased affinities.

    See the stub's docstring for the full contract.
    """
    _check_arguments(x_TD, router_weight_ED, expert_bias_E, k, route_scale)
    affinity_TE = torch.sigmoid(x_TD.float() @ router_weight_ED.float().T)
    expert_index_TK = _topk_ties_to_lowest_index(affinity_TE + expert_bias_E.float(), k)
    chosen_TK = affinity_TE.gather(1, expert_index_TK)
    # Folding route_scale into the divisor saves a pass over [T, k]; a sigmoid is positive, so the sum is too
    # (for logits above about -88, which float32 sigmoid resolves).
    gate_TK = chosen_TK / (chosen_TK.sum(dim=-1, keepdim=True) / route_scale)
    return SigmoidRouterOutput(expert_index_TK, gate_TK, _count_per_expert(expert_index_TK, affinity_TE.shape[1]))


def sigmoid_route_torch(
    x_TD: Tensor, router_weight_ED: Tensor, expert_bias_E: Tensor, k: int, route_scale: float = 1.0
) -> SigmoidRouterOutput:
    """The same routing as `sigmoid_route`, written as plainly as possible.

    One difference: it computes in float64 when any input is float64, and then returns its gates in float64. The
    grader evaluates it on float64 inputs to get the precise values that float32 computations are measured against.
    """
    _check_arguments(x_TD, router_weight_ED, expert_bias_E, k, route_scale)
    uses_float64 = torch.float64 in (x_TD.dtype, router_weight_ED.dtype, expert_bias_E.dtype)
    compute_dtype = torch.float64 if uses_float64 else torch.float32

    affinity_TE = torch.sigmoid(x_TD.to(compute_dtype) @ router_weight_ED.to(compute_dtype).T)
    selection_TE = affinity_TE + expert_bias_E.to(compute_dtype)
    # A stable sort keeps equal scores in ascending expert order.
    expert_index_TK = torch.sort(selection_TE, dim=-1, descending=True, stable=True).indices[:, :k]
    chosen_TK = affinity_TE.gather(1, expert_index_TK)
    gate_TK = route_scale * chosen_TK / chosen_TK.sum(dim=-1, keepdim=True)

    tokens_per_expert_E = torch.bincount(expert_index_TK.flatten(), minlength=affinity_TE.shape[1])
    return SigmoidRouterOutput(expert_index_TK, gate_TK, tokens_per_expert_E)
