"""Group-limited (device- or node-limited) routing: each token first picks a few groups of experts, then its
experts only within them."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class GroupRoutingOutput(NamedTuple):
    group_index_TM: Tensor  # int64 [T, M]
    expert_index_TK: Tensor  # int64 [T, k]
    gate_TK: Tensor  # float32 [T, k]


def group_limited_route(
    x_TD: Tensor,
    router_weight_ED: Tensor,
    num_groups: int,
    groups_per_token: int,
    k: int,
    route_scale: float = 1.0,
) -> GroupRoutingOutput:
    """Route each of T tokens to k of E experts, all of them within the token's M best of G expert groups.

    Arguments:
        x_TD: token activations, shape [T, D], a floating dtype (float32, float16 or bfloat16).
        router_weight_ED: router weights, shape [E, D], one row per expert; a floating dtype that need not be the
            dtype of `x_TD`.
        num_groups: G, the number of expert groups (devices or nodes); it must divide E. Group g holds the S = E / G
            *contiguous* experts g * S, ..., g * S + S - 1.
        groups_per_token: M, how many groups each token may use, 1 <= M <= G.
        k: number of experts per token, 1 <= k <= M * S.
        route_scale: a positive finite factor applied to every gate.

    Computation (all in float32, whatever the input dtypes):
        logits_TE   = x_TD @ router_weight_ED.T, with both operands cast to float32 before the product.
        affinity_TE = sigmoid(logits_TE), elementwise.
        Group score: for group g of token t, the sum of the two largest affinities among the group's S experts
            (one float32 addition); when S == 1, the group's single affinity. (Not the maximum, and not the sum
            over the whole group.)
        Groups: each token keeps the M groups of highest group score, listed by descending score; among equal
            scores the lower group index ranks first.
        Experts: each token then chooses the k experts of highest affinity among the M * S experts of its kept
            groups only (every other expert is excluded, however high its affinity), listed by descending affinity;
            among equal affinities the lower expert index ranks first. (torch.topk makes no promise for ties.)
        Gates: the affinities of the chosen experts, renormalised to sum to 1, times route_scale:
            gate_TK[t, j] = route_scale * affinity_TE[t, e_j] / sum_j' affinity_TE[t, e_j'],
            with e_j = expert_index_TK[t, j].

    Returns a GroupRoutingOutput whose fields, in this order, are:
        group_index_TM: int64 [T, M], the kept groups of each token, in the order above.
        expert_index_TK: int64 [T, k], the chosen experts of each token, in the order above.
        gate_TK: float32 [T, k], the gates above (each row sums to route_scale).

    Gradients: gate_TK is differentiable with respect to `x_TD` and `router_weight_ED` (the gradients arrive in
    each input's own dtype); the index outputs are integer tensors without gradient.

    Devices: CPU or CUDA; every output is on the device of `x_TD` (both inputs are on the same device).

    Raises:
        TypeError: if `x_TD` or `router_weight_ED` has a non-floating dtype.
        ValueError: if `x_TD` or `router_weight_ED` is not 2-D, their last dimensions (D) differ, T == 0,
            num_groups < 1 or does not divide E, groups_per_token is not in [1, num_groups], k is not in
            [1, groups_per_token * E / num_groups], or route_scale is not positive and finite.
    """
    raise NotImplementedError
