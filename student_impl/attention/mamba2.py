"""Mamba-2's scalar-gated linear attention (the SSD form): a reference loop, and the chunked scan in Triton."""

import torch
import triton
import triton.language as tl


class Mamba2Function(torch.autograd.Function):
    """The autograd function behind `mamba2_chunked`; see its docstring for the math and the conventions.

    forward(ctx, q, k, v, g, initial_state, chunk_size) -> (o, final_state)
        Launches your Triton kernels over chunks of C = chunk_size tokens. For chunk c of one (batch, head), with
        b_i the cumulative sum of g over the chunk from its first token up to and including token i, S_prev the
        state entering the chunk (initial_state, or zeros, for the first) and L the chunk's last token:
            o_i    = exp(b_i) q_i^T S_prev + sum_{j <= i in the chunk} (q_i . k_j) exp(b_i - b_j) v_j
            S_next = exp(b_L) S_prev + sum_{j in the chunk} exp(b_L - b_j) k_j v_j^T
        A suggested split: a kernel that walks the chunks in order and writes the state entering each chunk (one
        program per (batch*head, K block, V block)), then a kernel parallel over (chunk, batch*head, V block) for
        the outputs. Apply the causal mask j <= i to b_i - b_j BEFORE exponentiating, so that every exponent you
        evaluate is <= 0 and nothing overflows, however negative g is. The last chunk may be partial: mask it.
        Beyond allocating, viewing and copying tensors (torch.empty, zeros, ones, full, view, reshape, transpose,
        permute, expand, contiguous, clone, copy_, .to, slicing, indexing), torch may not compute here: the
        cumulative sums of g, the exponentials and the products all happen in your kernels. Reading values into
        Python (.item(), .tolist(), bool(tensor), ...) is refused. `ctx.save_for_backward` may hold the inputs and
        chunk-boundary states only (at most ceil(T / C) + 1 states of [K, V] per (batch, head)), or you recompute
        the states in backward; besides that, only plain Python values (chunk_size, whether there was an initial
        state) may be kept on ctx.

    backward(ctx, grad_o, grad_final_state) -> (dq, dk, dv, dg, d_initial_state, None)
        final_state is an output like o: its incoming gradient (None, or a tensor of zeros, when the caller did not
        use it) must flow into every gradient, so that running a sequence in two halves, the first half's
        final_state passed as the second's initial_state, and backpropagating through both gives the gradients of
        running it whole. Likewise grad_o may be None when only final_state was used. Your choice, either
        Triton kernels (e.g. the gradient with respect to the chunk-boundary states passed backwards over the
        chunks, then dq, dk, dv in parallel over chunks, then dg from them) or plain PyTorch that is itself chunked
        (loops over chunks, batched over batch and heads, never over single tokens' states). dq, dk and dv have the
        shapes and dtypes of q, k and v; dg is float32 of g's shape; d_initial_state is float32 [B, H, K, V], or
        None when initial_state was None; the last None is chunk_size's.
        dg without cancellation: g_t scales exactly those terms of o and of the final state that carry a key
        from before token t to token t or later, so dg_t is the sum of those terms' gradients. For t in chunk c,
        with dS_next the gradient reaching the chunk's S_next (grad_final_state for the last chunk, and for an
        earlier chunk the gradient of the state entering the next one) and <X, Y> the sum of X * Y:
            dg_t = sum_{i >= t} exp(b_i) q_i^T S_prev dO_i                                  (i in the chunk)
                 + sum_{i >= t} sum_{j < t} exp(b_i - b_j) (q_i . k_j) (dO_i . v_j)         (i, j in the chunk)
                 + exp(b_L) <dS_next, S_prev> + sum_{j < t} exp(b_L - b_j) k_j^T dS_next v_j
        that is, a reverse cumulative sum over the chunk, the sum over the pairs (i, j) of the [C, C] block that
        straddle t, one inner product per chunk, and a cumulative sum. Every term is one the loss really depends
        on through g_t. The shorter route, dg_t as the reverse cumulative sum of q_s . dq_s - k_s . dk_s (plus the
        final state's term), is exact algebra but not in float32: the diagonal terms (q_s . k_s)(dO_s . v_s), of
        size 1, enter both products and cancel only to rounding, an error far larger than the true dg when the
        decay is strong (and nonzero where dg is exactly 0, as at the first token without an initial state).
        Check your dg against autograd through a float64 loop of the recurrence.

    Neither pass may build a tensor with two dimensions of length T (a T x T score, decay or mask matrix), nor a
    stack of per-token states (more than ceil(T / C) + 1 states of [K, V] per (batch, head) alive at once).
    Kernels read their inputs and write their outputs themselves (the grader records the memory traffic of your
    kernels): no block (a Triton tensor of two or more dimensions) may be longer than 128 along any dimension.
    Each pass makes at most 4 Triton launches per chunk plus 8 (never one per token).
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                initial_state: torch.Tensor | None, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward pass by your Triton kernels: returns (o, final_state) and saves what backward needs."""
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad_o: torch.Tensor | None, grad_final_state: torch.Tensor | None):
        """The backward pass: returns (dq, dk, dv, dg, d_initial_state or None, None)."""
        raise NotImplementedError


def mamba2_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of `mamba2_chunked`, one token at a time: plain PyTorch, a Python loop over t.

    Same math, arguments, checks and returns as `mamba2_chunked` (no chunk_size): for t = 1..T the float32 state
    [B, H, K, V] is updated as S_t = exp(g_t) S_{t-1} + k_t v_t^T and read out as o_t = S_t^T q_t, every product
    and sum in float32, o rounded to q's dtype once at the end. Write it with out-of-place torch operations, so
    that autograd differentiates it. Triton is not needed here; no limit on the operations torch may do.
    Raises the same errors as `mamba2_chunked`, before any computation.
    """
    raise NotImplementedError


def mamba2_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   initial_state: torch.Tensor | None = None,
                   chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Scalar-gated linear attention by your Triton kernels; returns `Mamba2Function.apply(q, k, v, g,
    initial_state, chunk_size)`.

    For each batch b and head h, with a log decay g_t <= 0 per token (one scalar per head and token):
        S_0 = initial_state[b, h], or zeros when initial_state is None          (a [K, V] float32 state)
        S_t = exp(g_t) S_{t-1} + k_t v_t^T                                        for t = 1..T
        o_t = S_t^T q_t                                                           (token t's own k_t v_t^T included)
        final_state = S_T
    No feature map is applied and q is not scaled: the caller does both. Values g_t > 0 are outside the contract
    (not checked). The result must not depend on chunk_size beyond rounding. It must stay finite and accurate when g
    is strongly negative over many steps (g = -20 at every one of T = 4096 tokens, say) and when g = 0 exactly (no
    decay). torch.nn.functional.scaled_dot_product_attention must not be used. See Mamba2Function for what torch may
    do in each pass and for the limits on memory and tiles.

    If you read mamba_ssm (`mamba_chunk_scan_combined(x, dt, A, B, C, ...)`): its C, B, x are q, k, v here, and
    its log decay dt_t A is g_t here. Three differences, each failing the worked example of test_chunked_fp32
    (K = 16, V = 32, an initial state given) and test_recurrent_form:
      - no dt scaling of the input: mamba_ssm writes dt_t B_t x_t^T, here k_t v_t^T is written as given (the
        caller folds dt into k or v);
      - no D skip: mamba_ssm adds D x_t to its output, here o_t = S_t^T q_t only (the caller adds the skip);
      - the state's orientation: mamba_ssm's states are (batch, nheads, headdim, dstate), that is [V, K]; here
        initial_state and final_state are [B, H, K, V] (the other one has the wrong shape whenever K != V).

    Args:
        q, k: [B, H, T, K]; v: [B, H, T, V]. One dtype, float32, float16 or bfloat16. K and V each one of 16, 32,
            64 and 128 (they may differ); any T >= 1, not necessarily a multiple of chunk_size (mask the last
            chunk); any B, H >= 1. Any strides (e.g. views of a [B, T, H, K] tensor): pass them to your kernels,
            or make copies.
        g: float32 [B, H, T] whatever q's dtype, any strides.
        initial_state: None or float32 [B, H, K, V], any strides.
        chunk_size: C, one of 16, 32 and 64.
        All on one device: CUDA, or the CPU when Triton's interpreter is on (TRITON_INTERPRET=1).

    Returns:
        (o, final_state): o a new [B, H, T, V] tensor of q's dtype, final_state a new float32 [B, H, K, V] tensor.
        Every product, exponential and sum accumulates in float32 whatever the input dtype, the state included;
        o is rounded to q's dtype once, at the end. For float32 inputs every `tl.dot` multiplies at full float32
        precision (`input_precision="ieee"`: the default TF32 keeps 10 mantissa bits and misses the float32
        tolerance on a GPU). For float16 and bfloat16 inputs, an operand may be rounded to the input dtype right
        before the `tl.dot` that consumes it (decayed keys or scores, a chunk-boundary state), or kept in float32
        and multiplied at TF32 precision (`input_precision="tf32"`, as many mantissa bits as float16). Mind
        float16's range: its smallest value is about 6e-8, and decayed operands (exp(b_i) q_i, exp(b_L - b_j) k_j,
        decayed scores) fall far below it under strong decay; rounded to float16 they flush to zero and take with
        them gradients whose whole size is theirs (dg, d_initial_state), which the grader compares at their own
        scale. Gradients, through Mamba2Function.backward: dq, dk, dv in the inputs' dtype, dg and d_initial_state
        float32. Values and gradients are compared with those of the recurrence written out at float64, with
        tolerances set by the error of a reference implementation.

    Raises (checked before any kernel is launched):
        TypeError: q, k, v or g is not a torch.Tensor; q, k or v has a dtype other than float32, float16 and
            bfloat16, or their dtypes differ; g is not float32; initial_state is neither None nor a float32
            tensor.
        ValueError: q, k or v is not 4-D, or g not 3-D; k's shape differs from q's, or v's B, H or T from q's;
            a dimension is 0; K or V is not one of 16, 32, 64 and 128; g's shape is not [B, H, T];
            initial_state's shape is not [B, H, K, V]; the tensors are not all on one device; chunk_size is not
            one of 16, 32 and 64.
    """
    raise NotImplementedError
