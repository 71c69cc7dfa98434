"""Top-k token-choice router for a mixture-of-experts layer, with its load-balancing and z losses.

`topk_route` is the fast reference; `topk_route_torch` writes the same math as plainly as possible. The contract
(shapes, dtypes, tie-breaking, loss conventions, errors) is the docstring of the student stub of this module.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class RouterOutput(NamedTuple):
    expert_index_TK: Tensor  # int64 [T, k]
    gate_TK: Tensor  # float32 [T, k]
    tokens_per_expert_E: Tensor  # int64 [E]
    balance_loss: Tensor  # float32 scalar (0-d)
    z_loss: Tensor  # float32 scalar (0-d)


def _check_arguments(x_TD: Tensor, router_weight_ED: Tensor, k: int) -> None:
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
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must be in [1, E={num_experts}], got {k}")


def _topk_ties_to_lowest_index(probs_TE: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries of each row, ordered by (value descending, index ascending).

    Each float32 probability is packed with its expert's rank into one int64 key whose integer order is exactly
    that order, so top-k over the (all distinct) keys is exact and its order unique. Non-negative float32 values
    order like their bit patterns read as integers; the low 32 bits hold E - 1 - expert, so among equal
    probabilities the lower expert index has the larger key. Per entry this costs a 4-byte read, an 8-byte key
    write and read, and no full sort of the row.
    """
    num_experts = probs_TE.shape[-1]
    value_bits_TE = probs_TE.detach().view(torch.int32).to(torch.int64)
    rank_E = torch.arange(num_experts - 1, -1, -1, device=probs_TE.device)
    key_TE = (value_bits_TE << 32) | rank_E
    return key_TE.topk(k, dim=-1).indices


def topk_route(x_TD: Tensor, router_weight_ED: Tensor, k: int, normalize_topk: bool = True) -> RouterOutput:
    """Route each of T tokens to k of E experts and compute the balance and z losses, all in float32.

    See the stub's docstring for the full contract.
    """
    _check_arguments(x_TD, router_weight_ED, k)
    num_tokens, num_experts = x_TD.shape[0], router_weight_ED.shape[0]

    logits_TE = x_TD.float() @ router_weight_ED.float().T
    probs_TE = torch.softmax(logits_TE, dim=-1)

    expert_index_TK = _topk_ties_to_lowest_index(probs_TE, k)
    gate_TK = probs_TE.gather(1, expert_index_TK)
    if normalize_topk:
        # The top-1 probability is at least 1/E, so the sum is never zero.
        gate_TK = gate_TK / gate_TK.sum(dim=-1, keepdim=True)

    # scatter_add_ rather than bincount: bincount reads the largest index back to the host to size its output.
    assigned_experts = expert_index_TK.flatten()
    tokens_per_expert_E = torch.zeros(num_experts, dtype=torch.int64, device=x_TD.device)
    tokens_per_expert_E.scatter_add_(0, assigned_experts, torch.ones_like(assigned_experts))

    slot_fraction_E = tokens_per_expert_E.float() / (num_tokens * k)
    mean_prob_E = probs_TE.mean(dim=0)
    balance_loss = num_experts * torch.dot(slot_fraction_E, mean_prob_E)
    z_loss = torch.logsumexp(logits_TE, dim=-1).square().mean()

    return RouterOutput(expert_index_TK, gate_TK, tokens_per_expert_E, balance_loss, z_loss)


def topk_route_torch(x_TD: Tensor, router_weight_ED: Tensor, k: int, normalize_topk: bool = True) -> RouterOutput:
    """The same routing as `topk_route`, written as plainly as possible.

    One difference: it computes in float64 when either input is float64, and then returns its gates and losses in
    float64 (otherwise it computes in float32, like `topk_route`). The grader evaluates it on float64 inputs to
    get the precise values that float32 computations are measured against.
    """
    _check_arguments(x_TD, router_weight_ED, k)
    num_tokens, num_experts = x_TD.shape[0], router_weight_ED.shape[0]
    uses_float64 = torch.float64 in (x_TD.dtype, router_weight_ED.dtype)
    compute_dtype = torch.float64 if uses_float64 else torch.float32

    logits_TE = x_TD.to(compute_dtype) @ router_weight_ED.to(compute_dtype).T
    probs_TE = torch.softmax(logits_TE, dim=-1)

    # A stable sort keeps equal probabilities in ascending expert order.
    sorted_probs_TE, sorted_experts_TE = torch.sort(probs_TE, dim=-1, descending=True, stable=True)
    expert_index_TK = sorted_experts_TE[:, :k]
    gate_TK = sorted_probs_TE[:, :k]
    if normalize_topk:
        gate_TK = gate_TK / gate_TK.sum(dim=-1, keepdim=True)

    tokens_per_expert_E = torch.bincount(expert_index_TK.flatten(), minlength=num_experts)

    f_E = tokens_per_expert_E.to(compute_dtype) / (num_tokens * k)
    P_E = probs_TE.mean(dim=0)
    balance_loss = num_experts * (f_E * P_E).sum()
    z_loss = (torch.logsumexp(logits_TE, dim=-1) ** 2).mean()

    return RouterOutput(expert_index_TK, gate_TK, tokens_per_expert_E, balance_loss, z_loss)
