"""Sparse upcycling: a dense SwiGLU MLP turned into an MoE layer whose experts start as copies of it.

Wrong on purpose: the experts are expand() views of the dense weights (no memory copied), so all
experts, and the dense MLP, are one set of weights: training one expert trains them all.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class UpcycledMoE(NamedTuple):
    router_weight_ED: Tensor
    gate_proj_EHD: Tensor
    up_proj_EHD: Tensor
    down_proj_EDH: Tensor
    normalize_topk: bool


def upcycle(gate_proj_HD: Tensor, up_proj_HD: Tensor, down_proj_DH: Tensor, num_experts: int, router_std: float,
            seed: int) -> UpcycledMoE:
    weights = (gate_proj_HD, up_proj_HD, down_proj_DH)
    if not all(w.is_floating_point() for w in weights) or len({w.dtype for w in weights}) > 1:
        raise TypeError("the dense weights must share one floating dtype")
    if any(w.dim() != 2 for w in weights):
        raise ValueError("the dense weights must be 2-D")
    hidden, width = gate_proj_HD.shape
    if up_proj_HD.shape != (hidden, width) or down_proj_DH.shape != (width, hidden) or hidden * width == 0:
        raise ValueError("shapes must be [H, D], [H, D], [D, H] with H, D >= 1")
    if num_experts < 1 or not math.isfinite(router_std) or router_std < 0 or not 0 <= seed < 2**63:
        raise ValueError("num_experts, router_std or seed out of range")

    generator = torch.Generator(device="cpu").manual_seed(seed)
    router_weight_ED = torch.randn(num_experts, width, generator=generator, dtype=torch.float32) * router_std
    gate_proj_EHD = gate_proj_HD.detach().expand(num_experts, hidden, width)
    up_proj_EHD = up_proj_HD.detach().expand(num_experts, hidden, width)
    down_proj_EDH = down_proj_DH.detach().expand(num_experts, width, hidden)
    return UpcycledMoE(router_weight_ED.to(gate_proj_HD.device), gate_proj_EHD, up_proj_EHD, down_proj_EDH, True)
