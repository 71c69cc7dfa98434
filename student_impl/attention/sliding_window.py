"""Causal sliding-window attention, forward and backward, written in Triton."""

import torch
import triton
import triton.language as tl


class SlidingWindowAttentionFunction(torch.autograd.Function):
    """The autograd function behind `sliding_window_attention`; see its docstring for the math and conventions.

    forward(ctx, q, k, v, window) -> o
        Launches your Triton forward kernel: each program owns a block of queries of one (batch, head) and
        visits only the key blocks its queries' windows meet, from the block holding key
        max(0, first query - window + 1) to the block holding its last query, with the online softmax of
        FlashAttention-2. It calls exactly `ctx.save_for_backward(q, k, v, o, L)` (L: float32, shape
        q.shape[:-1], natural logarithm); besides that, only plain Python values (window) may be kept on ctx.

    backward(ctx, grad_o) -> (dq, dk, dv, None)
        Launches your Triton kernels: a pre-pass D = rowsum(o * grad_o), then kernels that rebuild
        P = exp(S - L) tile by tile from the saved L and visit only the blocks inside the window (the queries
        that see key j are j .. j + window - 1). The None is window's.

    Work: with the window fixed, every kernel's work grows linearly in seq. A block outside every window of a
    program is never visited: loading it and masking it off is the seq^2 work this problem removes (the grader
    counts the lanes your kernels load, masked lanes included, at three lengths; on a GPU it times them).
    No tensor with two dimensions of length seq; no block of any kernel longer than 128 along a dimension.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
        """The forward pass by your Triton kernel: returns o and saves (q, k, v, o, L)."""
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad_o: torch.Tensor):
        """The backward pass by your Triton kernels: returns (dq, dk, dv, None)."""
        raise NotImplementedError


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Causal attention over the last `window` keys; returns `SlidingWindowAttentionFunction.apply(...)`.

    For each batch and head, with n = seq, d = head_dim and s = 1 / sqrt(d):
        key j is visible to query i  iff  i - window < j <= i   (itself and the window - 1 keys before it)
        L[i] = log sum_{j visible to i} exp(s q[i] . k[j])      (natural logarithm)
        o[i] = sum_{j visible to i} exp(s q[i] . k[j] - L[i]) v[j]
    window = 1 gives o = v; a window of seq or more is causal attention. If you read flash-attn: its
    window_size=(left, 0) counts the keys before the query, so left = window - 1 here. The library attention and
    softmax (scaled_dot_product_attention, flex_attention, torch.softmax and their aliases) must not be used;
    beyond allocating, viewing and copying tensors, torch may not compute here (handout: "Do the work yourself").

    Args:
        q, k, v: tensors of one shape [batch, heads, seq, head_dim] (4-D only). Any seq >= 1; head_dim a
            multiple of 16 from 16 to 128 (pad to the next power of two with masks). One dtype, float32,
            float16 or bfloat16; on a CUDA device, or on the CPU under Triton's interpreter
            (TRITON_INTERPRET=1). Any strides: pass them to your kernels, or make copies.
        window: a Python int >= 1 (not a bool), possibly larger than seq.

    Returns:
        o, a new tensor with q's shape, dtype and device, accumulated in float32 and rounded once. For float32
        inputs every `tl.dot` multiplies at full precision (`input_precision="ieee"`); for float16 and
        bfloat16, P and dS may be rounded to the input dtype just before the `tl.dot` that consumes them.

    Gradients reach q, k and v through SlidingWindowAttentionFunction.backward; o, L and the gradients are
    compared with those of the written-out formula at float64.

    Raises (checked before any kernel is launched):
        TypeError: q, k or v is not a torch.Tensor or not float32, float16 or bfloat16, their dtypes differ,
            or window is not an int (a bool or a float is not).
        ValueError: q is not 4-D; k or v has another shape than q; a dimension has size 0; head_dim is not a
            multiple of 16 from 16 to 128; window < 1; q, k and v are on different devices.
    """
    raise NotImplementedError
