"""Noisy top-k gating: Gaussian noise, scaled per token and expert by a learned softplus, perturbs the router's
logits before top-k in training; evaluation is noise-free."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class NoisyTopKOutput(NamedTuple):
    expert_index_TK: Tensor  # int64 [T, k]
    gate_TK: Tensor  # float32 [T, k]
    noisy_logits_TE: Tensor  # float32 [T, E]


def noisy_topk_route(
    x_TD: Tensor,
    gate_weight_ED: Tensor,
    noise_weight_ED: Tensor,
    noise_TE: Tensor,
    k: int,
    training: bool,
) -> NoisyTopKOutput:
    """Route each of T tokens to k of E experts by noisy top-k gating.

    Arguments:
        x_TD: token activations, shape [T, D], a floating dtype (float32, float16 or bfloat16).
        gate_weight_ED: gating weights W_g, shape [E, D], a floating dtype.
        noise_weight_ED: noise weights W_noise, shape [E, D], a floating dtype.
        noise_TE: standard normal samples, shape [T, E], a floating dtype, drawn by the caller (so that routing is
            deterministic given them). Read only when `training`.
        k: number of experts per token, 1 <= k <= E.
        training: whether to add the noise. In evaluation (False) the routing is noise-free: noise_TE and
            noise_weight_ED do not influence any output (their shapes are still checked).

    Computation (all in float32: every operand is cast to float32 before it is used):
        clean_TE = x_TD @ gate_weight_ED.T.
        In training:   noisy_logits_TE = clean_TE + noise_TE * softplus(x_TD @ noise_weight_ED.T),
                       with softplus(z) = log(1 + exp(z)) (torch.nn.functional.softplus with its defaults).
        In evaluation: noisy_logits_TE = clean_TE.
        Top-k: each token keeps the k experts of largest noisy logit, listed by descending noisy logit; among equal
            logits the lower expert index ranks first. (torch.topk makes no such promise for ties.)
        Gates: a softmax over the k kept noisy logits only (the others count as -inf):
            gate_TK[t, j] = exp(H[t, e_j]) / sum_j' exp(H[t, e_j']),
                H = noisy_logits_TE, e_j = expert_index_TK[t, j].
            This equals a softmax over all E logits whose top k are then renormalised to sum to 1, but not the
            unrenormalised top k of a softmax over all E.

    Returns a NoisyTopKOutput whose fields, in this order, are:
        expert_index_TK: int64 [T, k], the chosen experts of each token, in the order above.
        gate_TK: float32 [T, k], the gates above (each row sums to 1).
        noisy_logits_TE: float32 [T, E], the logits top-k was taken over (the clean logits in evaluation).

    Gradients: gate_TK and noisy_logits_TE are differentiable with respect to `x_TD`, `gate_weight_ED` and, in
    training, `noise_weight_ED` (the gradients arrive in each input's own dtype). noise_TE needs no gradient.
    expert_index_TK is an integer tensor without gradient.

    Devices: CPU or CUDA; every output is on the device of `x_TD` (all inputs are on the same device).

    Raises:
        TypeError: if any of the four tensors has a non-floating dtype.
        ValueError: if `x_TD`, `gate_weight_ED` or `noise_weight_ED` is not 2-D, the two weights' shapes differ,
            their D differs from that of `x_TD`, T == 0, `noise_TE` is not of shape [T, E], or k is not in [1, E].
    """
    raise NotImplementedError
