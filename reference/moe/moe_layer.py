"""A mixture-of-experts feed-forward layer: top-k routed SwiGLU experts plus shared experts.

`moe_layer` is the fast reference: tokens sorted by expert, one contiguous slice and one pair of matmuls per expert,
the shared experts fused into one wide SwiGLU. `moe_layer_torch` evaluates every expert on every token and keeps the
chosen ones, as plainly as possible. The contract is the docstring of the student stub of this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .router import _topk_ties_to_lowest_index


def _check_arguments(x_TD: Tensor, router_weight_ED: Tensor, gate_proj_EHD: Tensor, up_proj_EHD: Tensor,
                     down_proj_EDH: Tensor, shared_gate_proj_SFD: Tensor, shared_up_proj_SFD: Tensor,
                     shared_down_proj_SDF: Tensor, k: int) -> None:
    named = {
        "x_TD": x_TD, "router_weight_ED": router_weight_ED, "gate_proj_EHD": gate_proj_EHD,
        "up_proj_EHD": up_proj_EHD, "down_proj_EDH": down_proj_EDH, "shared_gate_proj_SFD": shared_gate_proj_SFD,
        "shared_up_proj_SFD": shared_up_proj_SFD, "shared_down_proj_SDF": shared_down_proj_SDF,
    }
    for name, tensor in named.items():
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {getattr(tensor, 'dtype', type(tensor))}")
    for name, tensor in named.items():
        if name != "router_weight_ED" and tensor.dtype != x_TD.dtype:
            raise TypeError(f"{name} has dtype {tensor.dtype} but x_TD has {x_TD.dtype}")
    if x_TD.dim() != 2 or router_weight_ED.dim() != 2:
        raise ValueError("x_TD and router_weight_ED must be 2-D")
    for name, tensor in named.items():
        if name not in ("x_TD", "router_weight_ED") and tensor.dim() != 3:
            raise ValueError(f"{name} must be 3-D, got shape {tuple(tensor.shape)}")
    tokens, width = x_TD.shape
    experts, hidden = router_weight_ED.shape[0], gate_proj_EHD.shape[1]
    shared, shared_hidden = shared_gate_proj_SFD.shape[:2]
    expected = {
        "router_weight_ED": (experts, width), "gate_proj_EHD": (experts, hidden, width),
        "up_proj_EHD": (experts, hidden, width), "down_proj_EDH": (experts, width, hidden),
        "shared_gate_proj_SFD": (shared, shared_hidden, width), "shared_up_proj_SFD": (shared, shared_hidden, width),
        "shared_down_proj_SDF": (shared, width, shared_hidden),
    }
    for name, shape in expected.items():
        if tuple(named[name].shape) != shape:
            raise ValueError(f"{name} has shape {tuple(named[name].shape)}, expected {shape} from the others")
    if tokens == 0:
        raise ValueError("x_TD has no tokens (T == 0)")
    if experts == 0 or hidden == 0:
        raise ValueError("there must be at least one routed expert, of hidden size at least 1")
    if not 1 <= k <= experts:
        raise ValueError(f"k must be in [1, E={experts}], got {k}")


def _route(x_TD: Tensor, router_weight_ED: Tensor, k: int, normalize_topk: bool) -> tuple[Tensor, Tensor]:
    """(expert_index_TK, float32 gate_TK), exactly as moe.router chooses and weighs them."""
    probs_TE = torch.softmax(x_TD.float() @ router_weight_ED.float().T, dim=-1)
    expert_index_TK = _topk_ties_to_lowest_index(probs_TE, k)
    gate_TK = probs_TE.gather(1, expert_index_TK)
    if normalize_topk:
        gate_TK = gate_TK / gate_TK.sum(dim=-1, keepdim=True)
    return expert_index_TK, gate_TK


def _swiglu(x_ND: Tensor, gate_proj_HD: Tensor, up_proj_HD: Tensor, down_proj_DH: Tensor) -> Tensor:
    return F.linear(F.silu(F.linear(x_ND, gate_proj_HD)) * F.linear(x_ND, up_proj_HD), down_proj_DH)


def _shared_output(x_TD: Tensor, gate_proj_SFD: Tensor, up_proj_SFD: Tensor, down_proj_SDF: Tensor) -> Tensor:
    """Sum of the S shared experts' outputs: they are one SwiGLU of hidden size S * F, whose down-projection sums
    the experts' contributions inside one matmul (three matmuls instead of 3 S)."""
    shared, hidden, width = gate_proj_SFD.shape
    down_D_SF = down_proj_SDF.permute(1, 0, 2).reshape(width, shared * hidden)
    return _swiglu(x_TD, gate_proj_SFD.reshape(shared * hidden, width), up_proj_SFD.reshape(shared * hidden, width),
                   down_D_SF)


def _grouped_mm_applies(x_TD: Tensor, gate_proj_EHD: Tensor) -> bool:
    """torch's grouped GEMM (CUTLASS, Hopper and newer) takes bf16 operands whose rows are 16-byte aligned."""
    return (
        hasattr(torch, "_grouped_mm")
        and x_TD.is_cuda
        and x_TD.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x_TD.device) >= (9, 0)
        and x_TD.shape[1] % 8 == 0
        and gate_proj_EHD.shape[1] % 8 == 0
    )


def _grouped_swiglu(x_sorted_AD: Tensor, tokens_per_expert_E: Tensor, gate_proj_EHD: Tensor, up_proj_EHD: Tensor,
                    down_proj_EDH: Tensor) -> Tensor:
    """All experts in three launches: one expert's slice of a few thousand rows is one or two waves of tiles on the
    GPU's SMs, too few to fill it; a grouped GEMM schedules every expert's tiles together. No host sync."""
    ends_E = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)
    # [E, H, D] transposed is the column-major [E, D, H] operand the grouped GEMM wants, without a copy.
    gate_AH = torch._grouped_mm(x_sorted_AD, gate_proj_EHD.transpose(1, 2), offs=ends_E)
    up_AH = torch._grouped_mm(x_sorted_AD, up_proj_EHD.transpose(1, 2), offs=ends_E)
    return torch._grouped_mm(F.silu(gate_AH) * up_AH, down_proj_EDH.transpose(1, 2), offs=ends_E)


def _looped_swiglu(x_sorted_AD: Tensor, tokens_per_expert_E: Tensor, gate_proj_EHD: Tensor, up_proj_EHD: Tensor,
                   down_proj_EDH: Tensor) -> Tensor:
    """One SwiGLU per expert on its contiguous slice; one host sync reads the slice lengths."""
    # unbind rather than indexing expert by expert: its backward stacks the E weight gradients once, where each
    # index's backward would write a zero-filled gradient of all E experts.
    experts_weights = zip(gate_proj_EHD.unbind(0), up_proj_EHD.unbind(0), down_proj_EDH.unbind(0))
    outputs = [
        _swiglu(x_ND, *weights)
        for x_ND, weights in zip(x_sorted_AD.split(tokens_per_expert_E.tolist()), experts_weights)
        if x_ND.shape[0] > 0
    ]
    return torch.cat(outputs)


def moe_layer(x_TD: Tensor, router_weight_ED: Tensor, gate_proj_EHD: Tensor, up_proj_EHD: Tensor,
              down_proj_EDH: Tensor, shared_gate_proj_SFD: Tensor, shared_up_proj_SFD: Tensor,
              shared_down_proj_SDF: Tensor, k: int, normalize_topk: bool = True) -> Tensor:
    """The MoE layer's output y_TD in x_TD's dtype. See the stub's docstring for the full contract."""
    _check_arguments(x_TD, router_weight_ED, gate_proj_EHD, up_proj_EHD, down_proj_EDH, shared_gate_proj_SFD,
                     shared_up_proj_SFD, shared_down_proj_SDF, k)
    tokens, width = x_TD.shape
    experts = router_weight_ED.shape[0]
    expert_index_TK, gate_TK = _route(x_TD, router_weight_ED, k, normalize_topk)

    # Dispatch: the T k (token, slot) assignments in token-major order, stably sorted by expert, so that each
    # expert's rows are one contiguous slice in ascending token order.
    assigned_expert_A = expert_index_TK.flatten()
    order_A = torch.sort(assigned_expert_A, stable=True).indices
    tokens_per_expert_E = torch.bincount(assigned_expert_A, minlength=experts)
    x_sorted_AD = x_TD[order_A // k]
    if _grouped_mm_applies(x_TD, gate_proj_EHD):
        out_sorted_AD = _grouped_swiglu(x_sorted_AD, tokens_per_expert_E, gate_proj_EHD, up_proj_EHD, down_proj_EDH)
    else:
        out_sorted_AD = _looped_swiglu(x_sorted_AD, tokens_per_expert_E, gate_proj_EHD, up_proj_EHD, down_proj_EDH)

    # Combine: back to (token, slot) order by the inverse permutation (a gather, deterministic, no atomics), then
    # each token's k gated outputs and the shared experts' output are summed in float32 and rounded once.
    inverse_A = torch.empty_like(order_A)
    inverse_A[order_A] = torch.arange(order_A.numel(), device=order_A.device)
    out_TKD = out_sorted_AD[inverse_A].view(tokens, k, width)
    y_TD = torch.bmm(gate_TK.unsqueeze(1), out_TKD.float()).squeeze(1)
    if shared_gate_proj_SFD.shape[0] > 0:
        y_TD = y_TD + _shared_output(x_TD, shared_gate_proj_SFD, shared_up_proj_SFD, shared_down_proj_SDF).float()
    return y_TD.to(x_TD.dtype)


def moe_layer_torch(x_TD: Tensor, router_weight_ED: Tensor, gate_proj_EHD: Tensor, up_proj_EHD: Tensor,
                    down_proj_EDH: Tensor, shared_gate_proj_SFD: Tensor, shared_up_proj_SFD: Tensor,
                    shared_down_proj_SDF: Tensor, k: int, normalize_topk: bool = True) -> Tensor:
    """The same layer written as plainly as possible: every expert on every token, the chosen ones kept.

    It routes in float64 when its inputs are float64 (otherwise in float32, like `moe_layer`), and then returns
    float64: the grader evaluates it on float64 inputs for the precise values it measures against.
    """
    _check_arguments(x_TD, router_weight_ED, gate_proj_EHD, up_proj_EHD, down_proj_EDH, shared_gate_proj_SFD,
                     shared_up_proj_SFD, shared_down_proj_SDF, k)
    tokens = x_TD.shape[0]
    route_dtype = torch.float64 if x_TD.dtype == torch.float64 else torch.float32
    probs_TE = torch.softmax(x_TD.to(route_dtype) @ router_weight_ED.to(route_dtype).T, dim=-1)
    sorted_probs_TE, sorted_experts_TE = torch.sort(probs_TE, dim=-1, descending=True, stable=True)
    expert_index_TK, gate_TK = sorted_experts_TE[:, :k], sorted_probs_TE[:, :k]
    if normalize_topk:
        gate_TK = gate_TK / gate_TK.sum(dim=-1, keepdim=True)

    hidden_ETH = F.silu(torch.einsum("td,ehd->eth", x_TD, gate_proj_EHD)) * torch.einsum("td,ehd->eth", x_TD,
                                                                                      up_proj_EHD)
    out_ETD = torch.einsum("eth,edh->etd", hidden_ETH, down_proj_EDH)
    chosen_TKD = out_ETD[expert_index_TK, torch.arange(tokens, device=x_TD.device)[:, None]]
    y_TD = (gate_TK.unsqueeze(-1).to(chosen_TKD.dtype) * chosen_TKD).sum(dim=1)

    shared_hidden_STF = F.silu(torch.einsum("td,sfd->stf", x_TD, shared_gate_proj_SFD)) * torch.einsum(
        "td,sfd->stf", x_TD, shared_up_proj_SFD)
    y_TD = y_TD + torch.einsum("stf,sdf->td", shared_hidden_STF, shared_down_proj_SDF)
    return y_TD
