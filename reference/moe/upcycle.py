"""Sparse upcycling: a dense SwiGLU MLP turned into an MoE layer whose experts start as copies of it.

The contract (shapes, the router's initialisation, the independence of the copies, errors) is the docstring of the
student stub of this module.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class UpcycledMoE(NamedTuple):
    router_weight_ED: Tensor  # float32 [E, D]
    gate_proj_EHD: Tensor  # [E, H, D], the dense weights' dtype
    up_proj_EHD: Tensor  # [E, H, D]
    down_proj_EDH: Tensor  # [E, D, H]
    normalize_topk: bool


def _check_arguments(gate_proj_HD: Tensor, up_proj_HD: Tensor, down_proj_DH: Tensor, num_experts: int,
                     router_std: float, seed: int) -> None:
    named = {"gate_proj_HD": gate_proj_HD, "up_proj_HD": up_proj_HD, "down_proj_DH": down_proj_DH}
    for name, tensor in named.items():
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {getattr(tensor, 'dtype', type(tensor))}")
        if tensor.dtype != gate_proj_HD.dtype:
            raise TypeError(f"{name} has dtype {tensor.dtype} but gate_proj_HD has {gate_proj_HD.dtype}")
        if tensor.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(tensor.shape)}")
    hidden, width = gate_proj_HD.shape
    if tuple(up_proj_HD.shape) != (hidden, width) or tuple(down_proj_DH.shape) != (width, hidden):
        raise ValueError(f"shapes {tuple(gate_proj_HD.shape)}, {tuple(up_proj_HD.shape)}, "
                         f"{tuple(down_proj_DH.shape)} are not [H, D], [H, D], [D, H]")
    if hidden == 0 or width == 0:
        raise ValueError("H and D must be at least 1")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if not math.isfinite(router_std) or router_std < 0:
        raise ValueError(f"router_std must be finite and >= 0, got {router_std!r}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")


def upcycle(gate_proj_HD: Tensor, up_proj_HD: Tensor, down_proj_DH: Tensor, num_experts: int, router_std: float,
            seed: int) -> UpcycledMoE:
    """E independent copies of the dense MLP and a new Gaussian router. See the stub's docstring for the contract."""
    _check_arguments(gate_proj_HD, up_proj_HD, down_proj_DH, num_experts, router_std, seed)
    width = gate_proj_HD.shape[1]
    generator = torch.Generator(device="cpu").manual_seed(seed)
    router_weight_ED = torch.randn(num_experts, width, generator=generator, dtype=torch.float32) * router_std

    def copies(weight: Tensor) -> Tensor:
        # repeat allocates E fresh copies (expand would make E views of one storage); detach keeps the MoE's
        # parameters out of the dense weights' autograd graph.
        return weight.detach().unsqueeze(0).repeat(num_experts, 1, 1)

    return UpcycledMoE(router_weight_ED.to(gate_proj_HD.device), copies(gate_proj_HD), copies(up_proj_HD),
                       copies(down_proj_DH), True)
