"""Expert-choice routing: each expert chooses its top-c tokens."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class ExpertChoiceOutput(NamedTuple):
    token_index_EC: Tensor  # int64 [E, C]
    gate_EC: Tensor  # float32 [E, C]
    experts_per_token_T: Tensor  # int64 [T]


def expert_choice_route(x_TD: Tensor, router_weight_ED: Tensor, capacity_factor: float) -> ExpertChoiceOutput:
    """Let each of E experts choose C of the T tokens; a token may be chosen by several experts or by none.

    Arguments:
        x_TD: token activations, shape [T, D], a floating dtype (float32, float16 or bfloat16).
        router_weight_ED: router weights, shape [E, D], a floating dtype that need not be the dtype of `x_TD`.
        capacity_factor: a float > 0; on average each token is processed by capacity_factor experts.

    Capacity (pinned: rounded down, then clamped to [1, T]):
        C = min(T, max(1, floor(capacity_factor * T / E))), computed as
        min(T, max(1, math.floor(capacity_factor * T / E))) on Python floats.

    Computation (all in float32, whatever the input dtypes):
        logits_TE = x_TD @ router_weight_ED.T, with both operands cast to float32 before the product.
        probs_TE  = softmax of logits_TE over the EXPERTS (last dimension), one distribution per token, as in
                    Zhou et al. (2022). (Not over the tokens.)
        Each expert i ranks the T tokens by probs_TE[:, i], highest first, equal probabilities by ascending token
        index, and takes the first C of that order.

    Returns an ExpertChoiceOutput whose fields, in this order, are:
        token_index_EC: int64 [E, C], row i lists expert i's tokens in the order above.
        gate_EC: float32 [E, C], gate_EC[i, j] = probs_TE[token_index_EC[i, j], i].
        experts_per_token_T: int64 [T], how many experts chose each token (0 to E); sums to E * C.

    Gradients: gate_EC is differentiable with respect to both `x_TD` and `router_weight_ED` (the gradients arrive
    in each input's own dtype); the integer outputs carry no gradient.

    Devices: CPU or CUDA; every output is on the device of `x_TD` (both inputs are on the same device).

    Raises:
        TypeError: if `x_TD` or `router_weight_ED` has a non-floating dtype.
        ValueError: if either input is not 2-D, their last dimensions (D) differ, T == 0, E == 0, or
            capacity_factor <= 0.
    """
    raise NotImplementedError
