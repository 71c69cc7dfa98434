"""FlashAttention-2, forward and backward, written as plain PyTorch loops over tiles."""

import torch

# Queries and keys are both tiled in blocks of this many rows (the last block of each may be shorter).
TILE_SIZE = 16


class FlashAttentionFunction(torch.autograd.Function):
    """The autograd function behind `flash_attention`; see its docstring for the math and the conventions.

    forward(ctx, q, k, v, is_causal) -> o
        Loops over query tiles of TILE_SIZE rows and, inside, over key tiles of TILE_SIZE rows, keeping per query
        a running max m, a running sum l and an unnormalised output accumulator, all float32; when a key tile
        raises m from m_old to m_new, l and the accumulator are first multiplied by exp(m_old - m_new). Causal
        attention skips key tiles that lie entirely after the query tile. At the end o = acc / l and L = m + log(l).
        It calls exactly `ctx.save_for_backward(q, k, v, o, L)` (the inputs as given, the output, and L: float32,
        shape q.shape[:-1]); besides that, only plain Python values (is_causal, say) may be kept on ctx.

    backward(ctx, grad_o) -> (dq, dk, dv, None)
        First D = rowsum(o * grad_o) (float32, shape q.shape[:-1]); then, tile by tile, P = exp(S - L) is rebuilt
        from the saved L and dV += P^T dO, dP = dO V^T, dS = P * (dP - D), dQ += dS K / sqrt(d),
        dK += dS^T Q / sqrt(d). The gradients have the shapes and dtypes of q, k, v; the None is is_causal's.

    Neither pass may build a tensor with two dimensions of length seq (a score matrix, a probability matrix, a
    causal mask of all query-key pairs): only TILE_SIZE x TILE_SIZE blocks of them (per batch and head) exist at
    any time.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
        """The tiled forward pass: returns o and saves (q, k, v, o, L)."""
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad_o: torch.Tensor):
        """The tiled backward pass: returns (dq, dk, dv, None)."""
        raise NotImplementedError


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention computed tile by tile; returns `FlashAttentionFunction.apply(q, k, v, is_causal)`.

    For each batch and head, with n = seq, d = head_dim and s = 1 / sqrt(d):
        S[i, j] = s * (q[i] . k[j])                          for queries i < n and keys j < n
        L[i]    = log sum_{j visible to i} exp(S[i, j])      (natural logarithm)
        o[i]    = sum_{j visible to i} exp(S[i, j] - L[i]) * v[j]
    Every key is visible to every query, or, when is_causal, key j is visible to query i iff j <= i.
    The library attention and softmax (torch.nn.functional.scaled_dot_product_attention, torch.softmax and
    their aliases) must not be used.

    Args:
        q, k, v: tensors of one shape, either [batch, heads, seq, head_dim] or [batch*heads, seq, head_dim] (3-D:
            heads already merged into the batch). Any seq >= 1, not necessarily a multiple of TILE_SIZE; head_dim
            a multiple of 16 from 16 to 128. One dtype, float32, float16 or bfloat16; one device (the CPU or a
            GPU). Any strides (e.g. views of a [batch, seq, heads, head_dim] tensor).
        is_causal: whether query i attends only keys j <= i.

    Returns:
        o, a new tensor with q's shape, dtype and device. Products, exponentials and sums are computed in float32
        whatever the input dtype; o is rounded to q's dtype once, at the end. The logsumexp L saved for backward
        (see FlashAttentionFunction) is float32, of shape [batch, heads, seq] or [batch*heads, seq].

    Gradients reach q, k and v through FlashAttentionFunction.backward; they are compared with those of the
    written-out formula at float64, as are o and L.

    Raises (checked before any computation):
        TypeError: q, k or v is not a torch.Tensor, or has a dtype other than float32, float16 and bfloat16, or
            their dtypes differ.
        ValueError: q is not 3-D or 4-D; the key or value length differs from the query length; k or v has
            another shape than q; a dimension has size 0; head_dim is not a multiple of 16 from 16 to 128; q, k
            and v are on different devices.
    """
    raise NotImplementedError
