"""Total and activated parameter counts of a mixture-of-experts transformer."""

from __future__ import annotations

from typing import NamedTuple


class ParameterCounts(NamedTuple):
    embedding: int  # input embedding, plus the output projection unless tied
    attention: int  # all layers
    norms: int  # all RMSNorm weights
    dense_mlp: int  # the feed-forward blocks of the dense layers
    router: int  # all MoE layers
    shared_experts: int  # all MoE layers
    routed_experts: int  # every routed expert of every MoE layer
    activated_routed_experts: int  # the k routed experts one token uses, in every MoE layer
    total: int
    activated: int


def parameter_counts(
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_routed_experts: int,
    experts_per_token: int,
    expert_intermediate_size: int,
    num_shared_experts: int = 0,
    num_dense_layers: int = 0,
    dense_intermediate_size: int = 0,
    tied_embeddings: bool = False,
) -> ParameterCounts:
    """Count the parameters of a decoder-only MoE transformer, in total and as activated for one token.

    Architecture (pinned; every weight matrix has no bias). With H = hidden_size and V = vocab_size:
        Embedding: an input embedding [V, H] and an output projection [V, H]; with tied_embeddings the output
            projection is the input embedding, counted once.
        num_layers blocks, each: an RMSNorm (H weights) before attention, attention, an RMSNorm (H weights) before
            the feed-forward block, and the feed-forward block. One more RMSNorm (H weights) after the last block.
        Attention (grouped-query; multi-head when num_kv_heads == num_heads): query and output projections of
            H x (num_heads * head_dim) each, key and value projections of H x (num_kv_heads * head_dim) each.
            No other attention parameters (no biases, no query/key norms).
        The first num_dense_layers blocks have a dense SwiGLU feed-forward block with intermediate size
            dense_intermediate_size: three matrices (gate and up H x I, down I x H), 3 * H * I parameters.
        The other num_layers - num_dense_layers blocks are MoE blocks, each with
            a router: one H x num_routed_experts matrix (no bias, no per-expert correction bias);
            num_routed_experts routed experts and num_shared_experts shared experts, every one a SwiGLU block
            with intermediate size expert_intermediate_size (3 * H * expert_intermediate_size parameters).

    Activated parameters are those one token's forward pass uses: everything except the routed experts it is not
    routed to. So every term counts fully (embedding and output projection included, the router, the shared
    experts, the dense blocks), except that only experts_per_token routed experts per MoE block count.

    Returns a ParameterCounts of Python ints, in this order:
        embedding: V * H, or 2 * V * H when the embeddings are not tied.
        attention: over all num_layers blocks.
        norms: (2 * num_layers + 1) * H.
        dense_mlp: over the num_dense_layers dense blocks.
        router: over the MoE blocks.
        shared_experts: over the MoE blocks.
        routed_experts: all routed experts of all MoE blocks.
        activated_routed_experts: experts_per_token routed experts of each MoE block.
        total: embedding + attention + norms + dense_mlp + router + shared_experts + routed_experts.
        activated: total - routed_experts + activated_routed_experts.

    Raises:
        TypeError: if an argument is not an int (bool is not accepted as one), except tied_embeddings, which must
            be a bool.
        ValueError: if vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
            num_routed_experts or expert_intermediate_size is below 1; num_heads is not a multiple of
            num_kv_heads; experts_per_token is not in [1, num_routed_experts]; num_shared_experts is negative;
            num_dense_layers is not in [0, num_layers]; dense_intermediate_size is negative, or 0 while
            num_dense_layers > 0. (The MoE arguments are checked even when every block is dense.)
    """
    raise NotImplementedError
