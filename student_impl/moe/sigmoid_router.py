"""DeepSeek-V3 style routing: sigmoid affinities, a per-expert bias that steers the selection only, and gates taken
from the unbiased affinities."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class SigmoidRouterOutput(NamedTuple):
    expert_index_TK: Tensor  # int64 [T, k]
    gate_TK: Tensor  # float32 [T, k]
    tokens_per_expert_E: Tensor  # int64 [E]


def sigmoid_route(
    x_TD: Tensor, router_weight_ED: Tensor, expert_bias_E: Tensor, k: int, route_scale: float = 1.0
) -> SigmoidRouterOutput:
    """Route each of T tokens of width D to k of E experts by sigmoid affinities and a selection-only bias.

    Arguments:
        x_TD: token activations, shape [T, D], a floating dtype (float32, float16 or bfloat16).
        router_weight_ED: router weights, shape [E, D], one row per expert; a floating dtype that need not be the
            dtype of `x_TD`.
        expert_bias_E: per-expert bias, shape [E], a floating dtype. It is a balancing state, not a learned
            parameter: it changes which experts are chosen and nothing else.
        k: number of experts per token, 1 <= k <= E.
        route_scale: a positive finite factor applied to every gate.

    Computation (all in float32, whatever the input dtypes):
        logits_TE   = x_TD @ router_weight_ED.T, with both operands cast to float32 before the product.
        affinity_TE = sigmoid(logits_TE), elementwise (not a softmax over the experts).
        selection_TE = affinity_TE + expert_bias_E (bias cast to float32), one float32 addition per entry.
        Top-k: each token chooses the k experts of highest selection score. Ties are broken deterministically:
            among equal selection scores the lower expert index ranks first. The k experts of a token are listed
            by descending selection score, equal scores by ascending expert index, so expert_index_TK[t] is
            exactly the first k entries of the experts ordered by (selection score descending, expert index
            ascending). (torch.topk makes no such promise for ties.)
        Gates: the *unbiased* affinities of the chosen experts, renormalised to sum to 1, times route_scale:
            gate_TK[t, j] = route_scale * affinity_TE[t, e_j] / sum_j' affinity_TE[t, e_j'],
            with e_j = expert_index_TK[t, j]. The bias never enters a gate.

    Returns a SigmoidRouterOutput whose fields, in this order, are:
        expert_index_TK: int64 [T, k], the chosen experts of each token, in the order above.
        gate_TK: float32 [T, k], the gates above (each row sums to route_scale).
        tokens_per_expert_E: int64 [E], the number of tokens that chose each expert; sums to T * k.

    Gradients: gate_TK is differentiable with respect to `x_TD` and `router_weight_ED` (the gradients arrive in
    each input's own dtype); the bias receives no gradient; expert_index_TK and tokens_per_expert_E are integer
    tensors without gradient.

    Devices: CPU or CUDA; every output is on the device of `x_TD` (all inputs are on the same device).

    Raises:
        TypeError: if `x_TD`, `router_weight_ED` or `expert_bias_E` has a non-floating dtype.
        ValueError: if `x_TD` or `router_weight_ED` is not 2-D, their last dimensions (D) differ, T == 0,
            `expert_bias_E` is not of shape [E], k is not in [1, E], or route_scale is not positive and finite.
    """
    raise NotImplementedError
