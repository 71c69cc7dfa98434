"""Sparse upcycling: a dense SwiGLU MLP turned into an MoE layer whose experts start as copies of it."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class UpcycledMoE(NamedTuple):
    router_weight_ED: Tensor  # float32 [E, D]
    gate_proj_EHD: Tensor  # [E, H, D], the dense weights' dtype
    up_proj_EHD: Tensor  # [E, H, D]
    down_proj_EDH: Tensor  # [E, D, H]
    normalize_topk: bool


def upcycle(gate_proj_HD: Tensor, up_proj_HD: Tensor, down_proj_DH: Tensor, num_experts: int, router_std: float,
            seed: int) -> UpcycledMoE:
    """Turn the dense SwiGLU MLP  y = (silu(x @ gate_proj_HD.T) * (x @ up_proj_HD.T)) @ down_proj_DH.T  into the
    routed part of a moe.moe_layer layer (no shared expert) with num_experts experts that all start as copies of it.

    Arguments:
        gate_proj_HD, up_proj_HD: the dense gate and up projections [H, D]; down_proj_DH: its down projection
            [D, H]. One floating dtype for all three, one device (CPU or CUDA); H, D >= 1.
        num_experts: E >= 1.
        router_std: standard deviation of the new router's weights, finite and >= 0.
        seed: seeds the router's initialisation, 0 <= seed < 2**63.

    Returns an UpcycledMoE whose fields, in this order, are:
        router_weight_ED: float32 [E, D] on the dense weights' device, exactly
                generator = torch.Generator(device="cpu").manual_seed(seed)
                torch.randn(E, D, generator=generator, dtype=torch.float32) * router_std
            computed on the CPU, then moved to the device.
        gate_proj_EHD, up_proj_EHD: [E, H, D], down_proj_EDH: [E, D, H], in the dense weights' dtype and device,
            with every expert e an exact copy: gate_proj_EHD[e] equals gate_proj_HD bit for bit, and so on (the
            layouts are moe.moe_layer's, so down_proj_EDH[e] is down_proj_DH itself, not its transpose).
        normalize_topk: the gate normalisation the layer must be run with so that, at initialisation, its output
            equals the dense MLP's for every input and every k (whatever the router): True, since the k gates of a
            token then sum to 1, and k equal expert outputs weighted by gates summing to 1 are the dense output.

    The copies are independent parameters: each of the three expert tensors owns its memory, shared neither
    between experts (an in-place update of expert 0 leaves every other expert unchanged; expand() views fail this)
    nor with the dense weights (updating either afterwards leaves the other unchanged).

    Raises:
        TypeError: if a weight is not a floating tensor, or the three dtypes differ.
        ValueError: if a weight is not 2-D, the shapes are not [H, D], [H, D], [D, H], H or D is 0,
            num_experts < 1, router_std < 0 or not finite, or the seed is out of range.
    """
    raise NotImplementedError
