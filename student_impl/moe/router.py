"""Top-k token-choice router for a mixture-of-experts layer, with its load-balancing and z losses."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class RouterOutput(NamedTuple):
    expert_index_TK: Tensor  # int64 [T, k]
    gate_TK: Tensor  # float32 [T, k]
    tokens_per_expert_E: Tensor  # int64 [E]
    balance_loss: Tensor  # float32 scalar (0-d)
    z_loss: Tensor  # float32 scalar (0-d)


def topk_route(x_TD: Tensor, router_weight_ED: Tensor, k: int, normalize_topk: bool = True) -> RouterOutput:
    """Route each of T tokens of width D to k of E experts, and compute the router's auxiliary losses.

    Arguments:
        x_TD: token activations, shape [T, D], a floating dtype (float32, float16 or bfloat16).
        router_weight_ED: router weights, shape [E, D], one row per expert; a floating dtype that need not
            be the dtype of `x_TD`.
        k: number of experts per token, 1 <= k <= E.
        normalize_topk: whether to rescale each token's k gates so that they sum to 1.

    Computation (all in float32, whatever the input dtypes):
        logits_TE = x_TD @ router_weight_ED.T, with both operands cast to float32 before the product.
        probs_TE  = softmax of logits_TE over the experts (last dimension).
        Top-k: each token keeps the k experts of highest probability. Ties are broken deterministically:
            among equal probabilities the lower expert index ranks first. The k experts of a token are
            listed by descending probability, equal probabilities by ascending expert index. So
            expert_index_TK[t] is exactly the first k entries of the experts ordered by
            (probability descending, expert index ascending). (torch.topk makes no such promise for ties.)

    Returns a RouterOutput whose fields, in this order, are:
        expert_index_TK: int64 [T, k], the chosen experts of each token, in the order above.
        gate_TK: float32 [T, k], the chosen probabilities probs_TE[t, expert_index_TK[t, j]]; if
            normalize_topk, each row divided by its sum (so it sums to 1), else the raw softmax probabilities.
        tokens_per_expert_E: int64 [E], the number of (token, slot) assignments to each expert; sums to T * k.
        balance_loss: float32 0-d tensor, the Switch load-balancing loss
            balance_loss = E * sum_i f_i * P_i, where
            f_i = tokens_per_expert_E[i] / (T * k), the fraction of routing slots that go to expert i
                  (a count: it carries no gradient), and
            P_i = mean over tokens t of probs_TE[t, i], from the full softmax (before top-k and before
                  renormalisation).
            It equals 1 when routing is perfectly uniform (every f_i and P_i equal to 1 / E).
        z_loss: float32 0-d tensor, mean over tokens t of logsumexp(logits_TE[t])^2.

    Gradients: gate_TK, balance_loss (through P) and z_loss are differentiable with respect to both `x_TD`
    and `router_weight_ED` (the gradients arrive in each input's own dtype); expert_index_TK and
    tokens_per_expert_E are integer tensors without gradient.

    Devices: CPU or CUDA; every output is on the device of `x_TD` (both inputs are on the same device).

    Raises:
        TypeError: if `x_TD` or `router_weight_ED` has a non-floating dtype.
        ValueError: if `x_TD` is not 2-D, `router_weight_ED` is not 2-D, their last dimensions (D) differ,
            T == 0, or k is not in [1, E].
    """
    raise NotImplementedError
