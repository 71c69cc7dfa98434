"""What moe.moe_layer's speed test times: forward and backward of the layer on one large routing problem, beside
an idealised grouped GEMM of the same FLOPs (the baseline), and the oracle the students' copy checks a timed output
against (grader.speed.grading). Module-level functions: the student's worker builds the same inputs by name."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grader.speed.grading import SpeedSpec
from grader.speed.timing import sample_positions


def moe_layer_inputs(shape: tuple[int, ...], dtype: str, seed: int, device: torch.device) -> tuple:
    """The eight tensors (requiring gradients) of shape (T, D, H, E, k, S), then k and the upstream gradient of y."""
    tokens, width, hidden, experts, k, shared = shape
    generator = torch.Generator(device=device).manual_seed(seed)
    torch_dtype = getattr(torch, dtype)

    def normal(*size, scale):
        tensor = torch.randn(size, generator=generator, device=device, dtype=torch_dtype) * scale
        return tensor.requires_grad_(True)

    tensors = (
        normal(tokens, width, scale=1.0),
        normal(experts, width, scale=width**-0.5),
        normal(experts, hidden, width, scale=width**-0.5),
        normal(experts, hidden, width, scale=width**-0.5),
        normal(experts, width, hidden, scale=hidden**-0.5),
        normal(shared, hidden, width, scale=width**-0.5),
        normal(shared, hidden, width, scale=width**-0.5),
        normal(shared, width, hidden, scale=hidden**-0.5),
    )
    upstream = torch.randn(tokens, width, generator=generator, device=device, dtype=torch_dtype)
    return (*tensors, k, upstream)


def forward_backward(layer, *args) -> torch.Tensor:
    """The timed call: the layer's forward and its backward to all eight inputs."""
    *inputs, upstream = args
    y_TD = layer(*inputs)
    y_TD.backward(upstream)
    return y_TD.detach()


def idealised_grouped_gemm(x_TD, router_weight_ED, gate_proj_EHD, up_proj_EHD, down_proj_EDH, shared_gate_proj_SFD,
                           shared_up_proj_SFD, shared_down_proj_SDF, k):
    """The routed experts' matmuls as if they were one expert: the T k assigned rows through one [D -> H] pair and
    [H -> D] (the same FLOPs as any dispatch, with no routing, sorting or per-expert launches), plus the shared
    experts as one SwiGLU of hidden size S F."""
    tokens, width = x_TD.shape
    shared, shared_hidden = shared_gate_proj_SFD.shape[:2]
    x_AD = x_TD.repeat(k, 1)
    out_AD = F.linear(F.silu(F.linear(x_AD, gate_proj_EHD[0])) * F.linear(x_AD, up_proj_EHD[0]), down_proj_EDH[0])
    shared_down_D_SF = shared_down_proj_SDF.permute(1, 0, 2).reshape(width, shared * shared_hidden)
    shared_hidden_TF = F.silu(F.linear(x_TD, shared_gate_proj_SFD.reshape(-1, width))) * F.linear(
        x_TD, shared_up_proj_SFD.reshape(-1, width))
    return out_AD.view(k, tokens, width).sum(dim=0) + F.linear(shared_hidden_TF, shared_down_D_SF)


def swiglu_float32(x_ND, gate_proj_HD, up_proj_HD, down_proj_DH) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x_ND, gate_proj_HD.float())) * F.linear(x_ND, up_proj_HD.float()),
                    down_proj_DH.float())


# Tokens whose k-th and (k+1)-th router logits are closer than this may be routed either way by a correct float32
# computation (its rounding depends on the matmul's kernel): the oracle does not judge them.
ROUTING_MARGIN = 1e-3


@torch.no_grad()
def sampled_moe_layer(args: tuple, seed: int) -> torch.Tensor:
    """The layer's output (normalize_topk=True, as forward_backward calls it) at the positions
    grader.speed.timing.sample draws with `seed`, in float64: the students' copy checks a timed output against it,
    having no reference. Only the sampled tokens are computed, in float32, one expert at a time; NaN (not judged) for a
    token whose routing is within ROUTING_MARGIN of a tie."""
    x_TD, router_weight_ED, gate_proj_EHD, up_proj_EHD, down_proj_EDH, *shared_SXX, k, _ = args
    tokens, width = x_TD.shape
    positions = sample_positions(tokens * width, seed).to(x_TD.device)
    rows, row_of_position = torch.unique(positions // width, return_inverse=True)
    x_ND = x_TD.detach()[rows].float()
    logits_NE = x_ND @ router_weight_ED.detach().float().T
    ranked = torch.sort(logits_NE, dim=-1, descending=True, stable=True)
    expert_NK = ranked.indices[:, :k]
    gate_NK = torch.softmax(logits_NE, dim=-1).gather(1, expert_NK)
    gate_NK = gate_NK / gate_NK.sum(dim=-1, keepdim=True)
    y_ND = sum((swiglu_float32(x_ND, *weights) for weights in zip(*shared_SXX)), torch.zeros_like(x_ND))
    for expert in expert_NK.unique().tolist():
        row_A, slot_A = (expert_NK == expert).nonzero(as_tuple=True)
        expert_out_AD = swiglu_float32(x_ND[row_A], gate_proj_EHD[expert], up_proj_EHD[expert], down_proj_EDH[expert])
        y_ND.index_add_(0, row_A, gate_NK[row_A, slot_A, None] * expert_out_AD)
    if k < logits_NE.shape[1]:
        y_ND[ranked.values[:, k - 1] - ranked.values[:, k] < ROUTING_MARGIN] = float("nan")
    return y_ND[row_of_position, positions % width].to("cpu", torch.float64)


SPEEDS = {
    "moe.moe_layer": SpeedSpec("moe_layer", baseline=idealised_grouped_gemm, inputs=moe_layer_inputs,
                               harness=forward_backward, oracle=sampled_moe_layer),
}
