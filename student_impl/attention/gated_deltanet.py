"""Gated DeltaNet: the token-by-token recurrence in PyTorch, and the chunked form in Triton, forward and backward."""

import torch
import triton
import triton.language as tl


class GatedDeltaNetFunction(torch.autograd.Function):
    """The autograd function behind `gated_deltanet_chunked`; see its docstring for the math and the conventions.

    forward(ctx, q, k, v, g, beta, initial_state, chunk_size) -> (o, final_state)
        Launches your Triton kernels (arguments already checked by `gated_deltanet_chunked`). In this pass torch may
        only allocate, view and copy tensors (aten's empty*, zeros*, ones, full, view, reshape, transpose, permute,
        expand, contiguous, clone, copy_, _to_copy, slice, select and the like): every arithmetic operation, the
        cumulative sums of g and the triangular solve included, happens inside your kernels; no .item() or
        .tolist() either. A design that parallelises well (and the one the speed target assumes):
          1. per (chunk, batch*head): the chunk-local cumulative sum b of g, the UT transform T of the chunk (by
             forward substitution in the kernel), and the pseudo-keys w = T (exp(b) * K) and pseudo-values u = T V;
          2. per (batch*head, block of value columns): a walk over the chunks in order, with the float32 state in
             registers, writing each chunk's starting state and v_new = u - w S, and at the end the final state;
          3. per (chunk, batch*head, block of value columns): the outputs o of the chunk.
        ctx.save_for_backward may hold the inputs and the chunk-boundary states only (at most ceil(T / C) + 1 states
        of [K, V] per (batch, head), in float32 or in the input dtype); anything else the backward needs (b, w, u,
        v_new, ...) it recomputes. Plain Python values (chunk_size, whether initial_state was given) may be kept on
        ctx.

    backward(ctx, grad_o, grad_final_state) -> (dq, dk, dv, dg, dbeta, d_initial_state, None)
        Your choice, to be stated in a comment: Triton kernels (the goal: a reverse walk over the chunks carrying
        dS, the gradient of the state, plus kernels parallel over the chunks), or plain PyTorch that is itself
        chunked: per chunk, from the saved or recomputed chunk-boundary states, walking the chunks backwards while
        carrying dS, with explicit formulas or torch.autograd applied to one chunk at a time. grad_final_state, the
        gradient that reaches final_state, must be used: it is dS at the end of the sequence. So splitting a
        sequence in two, running the second half from the first half's final_state and backpropagating through
        both gives the gradients of the whole. The gradients have the shapes of q, k, v, g and beta; dq, dk and dv
        the dtype of q, k, v; dg, dbeta and d_initial_state are float32. d_initial_state is None when
        initial_state was None; the last None is chunk_size's.

    Either pass: no tensor may have two dimensions of length T (no [T, T] decay or score matrix), and no tensor
    may hold the state of every token (more than ceil(T / C) + 1 states of [K, V] per (batch, head)).
    Kernels read their inputs and write their outputs themselves (pass pointers and strides, or contiguous copies).
    Tiles: no block in any of your kernels (a Triton tensor of two or more dimensions, e.g. a [C, C] matrix of the
    chunk or a [K, BLOCK_V] slice of the state) may be longer than 128 along any dimension. Each pass makes at
    most 4 Triton launches per chunk plus 8 (never one per token).
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: torch.Tensor | None, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunked forward pass by your Triton kernels: returns (o, final_state) and saves what the backward
        needs (inputs and chunk-boundary states only)."""
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad_o: torch.Tensor, grad_final_state: torch.Tensor):
        """The backward pass (Triton kernels, or PyTorch chunked as above): returns
        (dq, dk, dv, dg, dbeta, d_initial_state or None, None)."""
        raise NotImplementedError


def gated_deltanet_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None,
                           chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet in chunks of `chunk_size` tokens by your Triton kernels; checks the arguments, then returns
    `GatedDeltaNetFunction.apply(q, k, v, g, beta, initial_state, chunk_size)`.

    The recurrence, for each batch b and head h, with per-token scalars g_t <= 0 (log-decay) and beta_t in (0, 1)
    (writing strength), and a float32 state S of shape [K, V]:
        S_0 = initial_state[b, h], or zeros when initial_state is None
        S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        for t = 1..T
        o_t = S_t^T q_t                                                          (token t's own write included)
        final_state[b, h] = S_T
    The keys are L2-normalised by the caller: do not normalise q or k, and do not scale q (the recurrence is defined
    for any k; the grader draws unit-norm keys).

    If you read the Gated DeltaNet paper: its state is d_v x d_k, S_t = S_{t-1} alpha_t (I - beta_t k_t k_t^T)
    + beta_t v_t k_t^T, read out as o_t = S_t q_t, with alpha_t in (0, 1). Here the state is its transpose, [K, V]
    per (batch, head), read out as o_t = S_t^T q_t, and g_t = log alpha_t: the decay is exp(g_t), never g_t itself.
    A state kept [V, K] gets the wrong shape of final_state in the worked example of test_chunked_fp32 (K = 16,
    V = 32, an initial state given); g used as alpha (a negative "decay") fails test_recurrent_form and
    test_chunked_fp32. If you read flash-linear-attention's `chunk_gated_delta_rule`: the same [K, V] state and
    log-space g, but it scales q by K^-1/2 unless told otherwise; here q is used as given (the grader draws q
    already scaled), and a second scaling fails the same tests.

    The chunked form, chunk by chunk (C = chunk_size; the last chunk may be shorter: mask it). Within a chunk, let b
    be the cumulative sum of g from the chunk's first token (b_i = g_1 + ... + g_i), S the state at the chunk's
    start, and K, V, Q the chunk's [C, K], [C, V], [C, K] rows. The product of the chunk's (I - beta k k^T) factors
    is carried by the WY / UT representation:
        A      = strictly-lower part of diag(beta) K K^T, each entry (i, j) scaled by its decay ratio
        T      = (I + A)^-1 diag(beta): solve the unit lower-triangular [C, C] system (I + A) T = diag(beta) by
                 forward substitution inside a Triton kernel (no torch.linalg.solve_triangular, no inverse in torch)
        w      = T (exp(b) * K),   u = T V                                       (pseudo-keys, pseudo-values)
    and then, across chunks, with S the state entering the chunk:
        v_new  = u - w S
        o      = exp(b) * (Q S) + (Q K^T * decay mask) v_new                    (mask: j <= i)
        S     <- exp(b_last) S + (exp(b_last - b) * K)^T v_new.
    Where exactly the decays go (A's ratios, the mask's entries) is for you to derive from the recurrence and to
    check numerically against `gated_deltanet_recurrent`. Mask before exponentiating, so that every exponent you
    take is <= 0: g = -20 at every step over thousands of tokens must give finite, exact outputs (no inf, no nan),
    and g = 0 exactly must work too. The result may not depend on chunk_size beyond rounding.

    Args:
        q, k: [B, H, T, K]; v: [B, H, T, V]. One dtype among float32, float16 and bfloat16. K and V each one of 16,
            32, 64 and 128 (they may differ). Any T >= 1 (not necessarily a multiple of chunk_size), B >= 1, H >= 1.
        g, beta: [B, H, T], float32 always (log-decay <= 0 and writing strength in (0, 1)).
        initial_state: None or [B, H, K, V] float32.
        chunk_size: 16, 32 or 64.
        All on one device: CUDA, or the CPU when Triton's interpreter is on (TRITON_INTERPRET=1). Any strides (e.g.
        k as a transposed view of a [B, T, H, K] tensor, or g sliced out of a wider one): pass the strides to your
        kernels, or make copies.

    Returns:
        (o, final_state): o is [B, H, T, V] in q's dtype; final_state is [B, H, K, V] float32. All products and sums
        accumulate in float32 and o is rounded to q's dtype once, when stored. For float32 inputs every `tl.dot`
        multiplies at full float32 precision (`input_precision="ieee"`); for float16 and bfloat16 inputs the
        operands of a `tl.dot` may be rounded to the input dtype just before it.

    Gradients reach q, k, v, g, beta and initial_state through GatedDeltaNetFunction.backward, from the upstream
    gradients of both o and final_state; they are compared with those of the recurrence at float64.

    Raises (checked before any kernel is launched):
        TypeError: q, k, v, g, beta (or initial_state, when given) is not a torch.Tensor; q, k or v has a dtype
            other than float32, float16 and bfloat16, or their dtypes differ; g, beta or initial_state is not
            float32.
        ValueError: q, k or v is not 4-D; their B, H or T differ; k's last dimension differs from q's; a dimension
            has size 0; K or V is not one of 16, 32, 64, 128; g or beta is not [B, H, T]; initial_state is not
            [B, H, K, V]; the tensors are on different devices; chunk_size is not 16, 32 or 64.
    """
    raise NotImplementedError


def gated_deltanet_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of `gated_deltanet_chunked`, token by token, in plain PyTorch.

    A Python loop over t = 1..T applying S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T and
    o_t = S_t^T q_t to all batches and heads at once, with the state S held in float32 (q, k, v read as float32);
    no chunks, no Triton. Arguments, conventions and raises as for `gated_deltanet_chunked`, without chunk_size.
    Returns (o, final_state): o [B, H, T, V] in q's dtype, final_state [B, H, K, V] float32. Differentiable by
    autograd in q, k, v, g, beta and initial_state (build each new state out of place).
    """
    raise NotImplementedError
