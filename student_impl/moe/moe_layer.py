"""A mixture-of-experts feed-forward layer: top-k routed SwiGLU experts plus shared experts."""

from __future__ import annotations

from torch import Tensor


def moe_layer(x_TD: Tensor, router_weight_ED: Tensor, gate_proj_EHD: Tensor, up_proj_EHD: Tensor,
              down_proj_EDH: Tensor, shared_gate_proj_SFD: Tensor, shared_up_proj_SFD: Tensor,
              shared_down_proj_SDF: Tensor, k: int, normalize_topk: bool = True) -> Tensor:
    """The output of an MoE feed-forward layer for T tokens of width D: E routed experts (k per token) and S shared
    experts (every token), each a SwiGLU MLP.

    Arguments (the layer's parameters are passed as tensors, one stacked tensor per projection):
        x_TD: token activations [T, D], T >= 1; float32, float16 or bfloat16.
        router_weight_ED: router weights [E, D], E >= 1; any floating dtype (routing is computed in float32).
        gate_proj_EHD, up_proj_EHD: the routed experts' gate and up projections [E, H, D], H >= 1.
        down_proj_EDH: the routed experts' down projections [E, D, H].
        shared_gate_proj_SFD, shared_up_proj_SFD: the shared experts' gate and up projections [S, F, D].
        shared_down_proj_SDF: the shared experts' down projections [S, D, F]. S = 0 (no shared expert) is allowed,
            as is F != H.
        k: experts per token, 1 <= k <= E.
        normalize_topk: whether each token's k gates are rescaled to sum to 1.
        Every tensor but router_weight_ED has the dtype of x_TD; all are on one device (CPU or CUDA).

    One expert with projections (gate_HD, up_HD, down_DH) maps a token x (a row vector of D values) to
        expert(x) = (silu(x @ gate_HD.T) * (x @ up_HD.T)) @ down_DH.T            (SwiGLU; silu(z) = z sigmoid(z))
    computed in x's dtype (as torch's matmuls in that dtype compute it).

    Routing, exactly as moe.router's topk_route: logits_TE = x_TD.float() @ router_weight_ED.float().T,
    probs_TE = softmax over the experts; each token keeps the k experts of highest probability, equal probabilities
    ranked by lower expert index first; its gates gate_TK are those float32 probabilities, divided by their sum
    when normalize_topk.

    Output, for every token t:
        y[t] = sum_j gate_TK[t, j] * expert_{e_tj}(x[t])  +  sum_s shared_s(x[t])
    where e_tj is the token's j-th chosen expert and shared_s is shared expert s (unweighted: every gate 1). The
    sum is accumulated in float32 (at least), and rounded to x's dtype once, at the end. Returns y_TD [T, D] in
    x_TD's dtype, on x_TD's device.

    Dispatch (required, and checked): no Python loop over tokens. Flatten the T * k (token, slot) assignments in
    token-major order, sort them by expert with a stable sort (so each expert's rows stay in ascending token
    order), and run each expert once on its contiguous slice of gathered rows; a loop over experts is fine, and
    so is skipping experts that received no token. The number of torch operations must not grow with T.
    Each token goes through its k routed experts only (and the shared ones): running every expert on every
    token and zeroing the unchosen outputs costs E / k times the work, and the matrix products' FLOPs are counted.

    Gradients flow to x_TD, router_weight_ED (through the gates) and all six projection tensors, each arriving
    in its own tensor's dtype; an expert that received no token gets a zero gradient.

    Raises:
        TypeError: if any argument is not a floating tensor, or a tensor other than router_weight_ED has a dtype
            different from x_TD's.
        ValueError: if x_TD or router_weight_ED is not 2-D or a projection not 3-D, if the shapes disagree (D, E,
            H, S, F as above), T == 0, E == 0 or H == 0, or k is not in [1, E].
    """
    raise NotImplementedError
