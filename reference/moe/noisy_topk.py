"""Noisy top-k gating: Gaussian noise, scaled per token and expert by a learned softplus, perturbs the router's
logits before top-k in training; evaluation is noise-free.

`noisy_topk_route` is the fast reference; `noisy_topk_route_torch` writes the same math as plainly as possible.
The contract (shapes, dtypes, tie-breaking, errors) is the docstring of the student stub of this module.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


class NoisyTopKOutput(NamedTuple):
    expert_index_TK: Tensor  # int64 [T, k]
    gate_TK: Tensor  # float32 [T, k]
    noisy_logits_TE: Tensor  # float32 [T, E]


def _check_arguments(x_TD: Tensor, gate_weight_ED: Tensor, noise_weight_ED: Tensor, noise_TE: Tensor,
                     k: int) -> None:
    tensors = (("x_TD", x_TD), ("gate_weight_ED", gate_weight_ED), ("noise_weight_ED", noise_weight_ED),
               ("noise_TE", noise_TE))
    for name, tensor in tensors:
        if not tensor.is_floating_point():
            raise TypeError(f"{name} must have a floating dtype, got {tensor.dtype}")
    for name, tensor in tensors[:3]:
        if tensor.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(tensor.shape)}")
    if gate_weight_ED.shape != noise_weight_ED.shape:
        raise ValueError(f"gate_weight_ED has shape {tuple(gate_weight_ED.shape)} but noise_weight_ED has shape "
                         f"{tuple(noise_weight_ED.shape)}")
    if x_TD.shape[1] != gate_weight_ED.shape[1]:
        raise ValueError(f"x_TD has D={x_TD.shape[1]} but the weights have D={gate_weight_ED.shape[1]}")
    if x_TD.shape[0] == 0:
        raise ValueError("x_TD has no tokens (T == 0)")
    num_experts = gate_weight_ED.shape[0]
    if tuple(noise_TE.shape) != (x_TD.shape[0], num_experts):
        raise ValueError(f"noise_TE must have shape ({x_TD.shape[0]}, {num_experts}), got {tuple(noise_TE.shape)}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must be in [1, E={num_experts}], got {k}")


def _topk_ties_to_lowest_index(scores_TE: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries of each row of a float32 tensor, ordered by (value descending, index
    ascending).

    Each logit is packed with its expert's rank into one int64 key whose integer order is exactly that order, so
    top-k over the (all distinct) keys is exact and its order unique. Read as int32, non-negative floats order
    like their bits; flipping the 31 low bits of negative ones makes all of them do so (adding 0.0 first turns
    -0.0, which equals 0.0, into 0.0). The low 32 bits hold E - 1 - expert, so among equal logits the lower
    expert index has the larger key.
    """
    num_experts = scores_TE.shape[-1]
    bits_TE = (scores_TE.detach() + 0.0).view(torch.int32)
    ordered_bits_TE = torch.where(bits_TE < 0, bits_TE ^ 0x7FFFFFFF, bits_TE).to(torch.int64)
    rank_E = torch.arange(num_experts - 1, -1, -1, device=scores_TE.device)
    return ((ordered_bits_TE << 32) | rank_E).topk(k, dim=-1).indices


def noisy_topk_route(
    x_TD: Tensor,
    gate_weight_ED: Tensor,
    noise_weight_ED: Tensor,
    noise_TE: Tensor,
    k: int,
    training: bool,
) -> NoisyTopKOutput:
    """Noisy top-k routing: noisy logits in training, clean ones in evaluation, softmax over the kept k.

    See the stub's docstring for the full contract.
    """
    _check_arguments(x_TD, gate_weight_ED, noise_weight_ED, noise_TE, k)
    x32_TD = x_TD.float()
    noisy_logits_TE = x32_TD @ gate_weight_ED.float().T
    if training:
        noise_std_TE = F.softplus(x32_TD @ noise_weight_ED.float().T)
        noisy_logits_TE = torch.addcmul(noisy_logits_TE, noise_TE.float(), noise_std_TE)
    expert_index_TK = _topk_ties_to_lowest_index(noisy_logits_TE, k)
    gate_TK = torch.softmax(noisy_logits_TE.gather(1, expert_index_TK), dim=-1)
    return NoisyTopKOutput(expert_index_TK, gate_TK, noisy_logits_TE)


def noisy_topk_route_torch(
    x_TD: Tensor,
    gate_weight_ED: Tensor,
    noise_weight_ED: Tensor,
    noise_TE: Tensor,
    k: int,
    training: bool,
) -> NoisyTopKOutput:
    """The same routing as `noisy_topk_route`, written as plainly as possible.

    One difference: it computes in float64 when any input is float64, and then returns its gates and logits in
    float64. The grader evaluates it on float64 inputs to get the precise values that float32 computations are
    measured against.
    """
    _check_arguments(x_TD, gate_weight_ED, noise_weight_ED, noise_TE, k)
    uses_float64 = torch.float64 in (x_TD.dtype, gate_weight_ED.dtype, noise_weight_ED.dtype, noise_TE.dtype)
    dtype = torch.float64 if uses_float64 else torch.float32

    x_TD = x_TD.to(dtype)
    clean_TE = x_TD @ gate_weight_ED.to(dtype).T
    if training:
        noise_std_TE = torch.log1p(torch.exp(x_TD @ noise_weight_ED.to(dtype).T))
        noisy_logits_TE = clean_TE + noise_TE.to(dtype) * noise_std_TE
    else:
        noisy_logits_TE = clean_TE

    # A stable sort keeps equal logits in ascending expert order.
    expert_index_TK = torch.sort(noisy_logits_TE, dim=-1, descending=True, stable=True).indices[:, :k]
    kept_TE = torch.full_like(noisy_logits_TE, -math.inf).scatter(1, expert_index_TK,
                                                                   noisy_logits_TE.gather(1, expert_index_TK))
    gate_TK = torch.softmax(kept_TE, dim=-1).gather(1, expert_index_TK)
    return NoisyTopKOutput(expert_index_TK, gate_TK, noisy_logits_TE)
