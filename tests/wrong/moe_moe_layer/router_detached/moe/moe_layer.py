"""A mixture-of-experts feed-forward layer: top-k routed SwiGLU experts plus shared experts.

Wrong on purpose: the router runs without autograd (as if routing were not trained), so the router
weights and the routing path of x receive no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _check(x_TD, router_weight_ED, projections, k):
    for tensor in (x_TD, router_weight_ED, *projections):
        if not tensor.is_floating_point():
            raise TypeError("every argument must be a floating tensor")
    if any(t.dtype != x_TD.dtype for t in projections):
        raise TypeError("the projections must have x_TD's dtype")
    if x_TD.dim() != 2 or router_weight_ED.dim() != 2 or any(t.dim() != 3 for t in projections):
        raise ValueError("x_TD and router_weight_ED must be 2-D, the projections 3-D")
    gate, up, down, shared_gate, shared_up, shared_down = projections
    (tokens, width), experts, hidden = x_TD.shape, router_weight_ED.shape[0], gate.shape[1]
    shared, shared_hidden = shared_gate.shape[:2]
    if (router_weight_ED.shape != (experts, width) or gate.shape != (experts, hidden, width)
            or up.shape != gate.shape or down.shape != (experts, width, hidden)
            or shared_gate.shape != (shared, shared_hidden, width) or shared_up.shape != shared_gate.shape
            or shared_down.shape != (shared, width, shared_hidden)):
        raise ValueError("shapes disagree")
    if tokens == 0 or hidden == 0 or not 1 <= k <= experts:
        raise ValueError("T, H or k out of range")


def _expert(x_ND, gate_HD, up_HD, down_DH):
    return (F.silu(x_ND @ gate_HD.T) * (x_ND @ up_HD.T)) @ down_DH.T


def moe_layer(x_TD: Tensor, router_weight_ED: Tensor, gate_proj_EHD: Tensor, up_proj_EHD: Tensor,
              down_proj_EDH: Tensor, shared_gate_proj_SFD: Tensor, shared_up_proj_SFD: Tensor,
              shared_down_proj_SDF: Tensor, k: int, normalize_topk: bool = True) -> Tensor:
    shared_projections = (shared_gate_proj_SFD, shared_up_proj_SFD, shared_down_proj_SDF)
    _check(x_TD, router_weight_ED, (gate_proj_EHD, up_proj_EHD, down_proj_EDH, *shared_projections), k)
    tokens, width = x_TD.shape
    experts = router_weight_ED.shape[0]

    with torch.no_grad():
        probs_TE = torch.softmax(x_TD.float() @ router_weight_ED.float().T, dim=-1)
    # A stable descending sort ranks equal probabilities by ascending expert index.
    sorted_probs_TE, sorted_experts_TE = torch.sort(probs_TE, dim=-1, descending=True, stable=True)
    expert_index_TK, gate_TK = sorted_experts_TE[:, :k], sorted_probs_TE[:, :k]
    if normalize_topk:
        gate_TK = gate_TK / gate_TK.sum(dim=-1, keepdim=True)

    assigned_A = expert_index_TK.flatten()
    order_A = torch.argsort(assigned_A, stable=True)
    token_A = order_A // k
    gate_A = gate_TK.flatten()[order_A]
    counts = torch.bincount(assigned_A, minlength=experts).tolist()

    y_TD = torch.zeros(tokens, width, dtype=torch.float32, device=x_TD.device)
    start = 0
    for expert, count in enumerate(counts):
        rows = slice(start, start + count)
        start += count
        if count == 0:
            continue
        out_ND = _expert(x_TD[token_A[rows]], gate_proj_EHD[expert], up_proj_EHD[expert], down_proj_EDH[expert])
        y_TD = y_TD.index_add(0, token_A[rows], out_ND.float() * gate_A[rows, None])
    for gate_FD, up_FD, down_DF in zip(*shared_projections):
        y_TD = y_TD + _expert(x_TD, gate_FD, up_FD, down_DF).float()
    return y_TD.to(x_TD.dtype)
