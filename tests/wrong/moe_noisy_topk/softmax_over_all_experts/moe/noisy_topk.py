"""Noisy top-k gating: Gaussian noise, scaled per token and expert by a learned softplus, perturbs the router's
logits before top-k in training; evaluation is noise-free.

Wrong on purpose: the gates are the top-k entries of a softmax over all E experts, not renormalised.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


class NoisyTopKOutput(NamedTuple):
    expert_index_TK: Tensor
    gate_TK: Tensor
    noisy_logits_TE: Tensor


def noisy_topk_route(
    x_TD: Tensor,
    gate_weight_ED: Tensor,
    noise_weight_ED: Tensor,
    noise_TE: Tensor,
    k: int,
    training: bool,
) -> NoisyTopKOutput:
    for tensor in (x_TD, gate_weight_ED, noise_weight_ED, noise_TE):
        if not tensor.is_floating_point():
            raise TypeError("every tensor argument must have a floating dtype")
    if x_TD.dim() != 2 or gate_weight_ED.dim() != 2 or gate_weight_ED.shape != noise_weight_ED.shape:
        raise ValueError("x_TD and the weights must be 2-D, and the two weights of one shape")
    if x_TD.shape[1] != gate_weight_ED.shape[1] or x_TD.shape[0] == 0:
        raise ValueError("x_TD and the weights have different widths D, or there are no tokens")
    num_tokens, num_experts = x_TD.shape[0], gate_weight_ED.shape[0]
    if noise_TE.shape != (num_tokens, num_experts) or not 1 <= k <= num_experts:
        raise ValueError("noise_TE must be [T, E], and k must be in [1, E]")

    x = x_TD.float()
    logits = x @ gate_weight_ED.float().T
    if training:
        logits = logits + noise_TE.float() * F.softplus(x @ noise_weight_ED.float().T)
    expert_index = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
    gates = torch.softmax(logits, dim=-1).gather(1, expert_index)
    return NoisyTopKOutput(expert_index, gates, logits)
