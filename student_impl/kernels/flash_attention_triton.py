"""FlashAttention-2, forward and backward, written in Triton."""

import torch
import triton
import triton.language as tl


class FlashAttentionFunction(torch.autograd.Function):
    """The autograd function behind `flash_attention`; see its docstring for the math and the conventions.

    forward(ctx, q, k, v, is_causal) -> o
        Launches your Triton forward kernel: each program owns a block of queries of one (batch, head) and loops
        over the key blocks with the online softmax (running max m, running sum l and an output accumulator, all
        float32, rescaled by exp(m_old - m_new) whenever the max grows), then writes o = acc / l and L = m + log(l).
        Causal programs skip the key blocks that lie entirely after their query block. It calls exactly
        `ctx.save_for_backward(q, k, v, o, L)` (the inputs as given, the output, and L: float32, shape
        q.shape[:-1], natural logarithm even if your kernel works in base 2); besides that, only plain Python
        values (is_causal, say) may be kept on ctx.

    backward(ctx, grad_o) -> (dq, dk, dv, None)
        Launches your Triton kernels: a pre-pass D = rowsum(o * grad_o) (float32), then either a dK/dV kernel
        (one program per key block, looping over query blocks) and a dQ kernel (one per query block, looping over
        key blocks), or one fused pass. Each rebuilds P = exp(S - L) tile by tile from the saved L:
        dV += P^T dO, dP = dO V^T, dS = P * (dP - D), dQ += dS K / sqrt(d), dK += dS^T Q / sqrt(d).
        The gradients have the shapes and dtypes of q, k, v; the None is is_causal's.

    Neither pass may build a tensor with two dimensions of length seq (a score, probability or mask matrix).
    Tiles: no block in any of your kernels (a Triton tensor of two or more dimensions, e.g. a [BLOCK_M, BLOCK_N]
    score tile or a [BLOCK_N, head_dim] key tile) may be longer than 128 along any dimension, so that a sequence
    longer than 128 is always streamed in tiles, never held whole.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
        """The forward pass by your Triton kernel: returns o and saves (q, k, v, o, L)."""
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad_o: torch.Tensor):
        """The backward pass by your Triton kernels: returns (dq, dk, dv, None)."""
        raise NotImplementedError


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention by your Triton kernels; returns `FlashAttentionFunction.apply(q, k, v, is_causal)`.

    For each batch and head, with n = seq, d = head_dim and s = 1 / sqrt(d):
        S[i, j] = s * (q[i] . k[j])                          for queries i < n and keys j < n
        L[i]    = log sum_{j visible to i} exp(S[i, j])      (natural logarithm)
        o[i]    = sum_{j visible to i} exp(S[i, j] - L[i]) * v[j]
    Every key is visible to every query, or, when is_causal, key j is visible to query i iff j <= i.
    The library attention and softmax (torch.nn.functional.scaled_dot_product_attention, torch.softmax and
    their aliases) must not be used; the forward and the backward must each launch your Triton kernels.
    Beyond allocating, viewing and copying tensors, torch may not compute here (handout: "Do the work yourself").

    Args:
        q, k, v: tensors of one shape, either [batch, heads, seq, head_dim] or [batch*heads, seq, head_dim] (3-D:
            heads already merged into the batch). Any seq >= 1, not necessarily a multiple of your block sizes
            (mask the last blocks); head_dim a multiple of 16 from 16 to 128 (48, 80, 96 and 112 included: pad
            to the next power of two with masks). One dtype, float32, float16 or bfloat16; on a CUDA device, or
            on the CPU when Triton's interpreter is on (TRITON_INTERPRET=1). Any strides (e.g. views of a
            [batch, seq, heads, head_dim] tensor): pass them to your kernels, or make copies.
        is_causal: whether query i attends only keys j <= i.

    Returns:
        o, a new tensor with q's shape, dtype and device. Products, exponentials and sums accumulate in float32
        whatever the input dtype; o is rounded to q's dtype once, at the end. For float32 inputs, every `tl.dot`
        must multiply at full float32 precision (`input_precision="ieee"`): the default TF32 keeps 10 mantissa
        bits and misses the float32 tolerance on a GPU. For float16 and bfloat16 inputs, the probabilities P and
        dS may be rounded to the input dtype just before the `tl.dot` that consumes them. The logsumexp L saved
        for backward (see FlashAttentionFunction) is float32, of shape [batch, heads, seq] or [batch*heads, seq].

    Gradients reach q, k and v through FlashAttentionFunction.backward; they are compared with those of the
    written-out formula at float64, as are o and L.

    Raises (checked before any kernel is launched):
        TypeError: q, k or v is not a torch.Tensor, or has a dtype other than float32, float16 and bfloat16, or
            their dtypes differ.
        ValueError: q is not 3-D or 4-D; the key or value length differs from the query length; k or v has
            another shape than q; a dimension has size 0; head_dim is not a multiple of 16 from 16 to 128; q, k
            and v are on different devices.
    """
    raise NotImplementedError
