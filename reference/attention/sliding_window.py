"""Causal sliding-window attention, forward and backward in Triton, FlashAttention-2 style.

Query i attends key j iff i - window < j <= i: itself and the window - 1 keys before it (window >= 1; a window of
at least seq is causal attention). Every program visits only the key (or query) blocks that meet its window, so
the work per (batch, head) is about seq * (window + block) score entries, not the seq^2 / 2 of causal attention.

Forward: one program per (query block, batch*head) walks the key blocks from the one holding key
max(0, query_start - window + 1) to the one holding its last query, with the online softmax, and writes O and the
logsumexp L. Blocks wholly inside every one of its queries' windows run without masks; only the blocks on the
window's lower edge and on the diagonal are masked. HBM traffic per query block: Q once, (window + BLOCK_M) rows of
K and V, O and L once: (2 + 2 (window + BLOCK_M) / BLOCK_M) d e bytes a query.
Backward: a pre-pass computes D = rowsum(O * dO); one program per key block walks the query blocks that see it
(from the key block's diagonal up to key + window - 1) for dK and dV, one per query block walks the key blocks it
sees for dQ, both rebuilding P = exp(S - L) from the saved L, so neither needs atomics.

Each program walks its blocks in one loop, and a test on the block's start (`_on_edge`) picks the masked path. A
window of 1024 is only about 17 blocks of 64: split into three loops (lower edge, inside, diagonal), every loop paid
the software pipeline's fill and drain, and forward and backward took 11 % longer (H100, T = 32768).
"""

import math

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 16, 128, 16

LOG2_E = 1.4426950408889634
_LOG2_E = tl.constexpr(LOG2_E)
_LN_2 = tl.constexpr(0.6931471805599453)
PREPASS_BLOCK = 64


def check_arguments(q, k, v, window) -> None:
    """The contract's argument checks."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"sliding_window_attention expects {name} to be a torch.Tensor, got "
                            f"{type(tensor).__name__}")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"sliding_window_attention supports dtypes {SUPPORTED_DTYPES}, got {name} of "
                            f"{tensor.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"window must be a Python int, got {type(window).__name__}")
    if q.ndim != 4:
        raise ValueError(f"q must be 4-D [batch, heads, seq, head_dim], got shape {tuple(q.shape)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k and v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if 0 in q.shape:
        raise ValueError(f"every dimension must be at least 1, got shape {tuple(q.shape)}")
    head_dim = q.shape[-1]
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_MULTIPLE == 0):
        raise ValueError(f"head_dim must be a multiple of {HEAD_DIM_MULTIPLE} from {MIN_HEAD_DIM} to {MAX_HEAD_DIM}, "
                         f"got {head_dim}")
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")


def _config(dtype: torch.dtype, head_dim_block: int) -> dict:
    if triton.knobs.runtime.interpret:
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8 if head_dim_block <= 64 else 16, num_stages=2)
    # bfloat16 on the H100, batch 4, 16 heads: 2.8 ms at T = 32768, head size 128, window 1024, against 3.4 for
    # 128 x 64 at 8 warps; 0.24 ms at T = 8192, head size 64, window 512, against 0.33 for 128 x 64 at 4 warps.
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)


def _backward_config(dtype: torch.dtype, head_dim_block: int) -> dict:
    if triton.knobs.runtime.interpret:
        return dict(BLOCK_MAJOR=32, BLOCK_MINOR=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_MAJOR=64 if head_dim_block <= 64 else 32, BLOCK_MINOR=16, num_warps=8, num_stages=2)
    # Forward and backward in bfloat16 on the H100, batch 4, 16 heads, window 1024, head size 128: 11.2 ms at
    # T = 32768 with two stages, 13.2 with three, 11.8 for 128 x 64 at 8 warps and three stages.
    return dict(BLOCK_MAJOR=64, BLOCK_MINOR=64, num_warps=4, num_stages=3 if head_dim_block <= 64 else 2)


@triton.jit
def _load(ptr, rows, cols, row_stride, col_stride, n_rows, n_cols, PAD_D: tl.constexpr):
    """A [rows, cols] tile, zero past the sequence's end and, when the head is padded, past head_dim."""
    mask = rows[:, None] < n_rows
    if PAD_D:
        mask = mask & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * row_stride + cols[None, :] * col_stride, mask=mask, other=0.0)


@triton.jit
def _store(ptr, tile, rows, cols, row_stride, n_rows, n_cols):
    tl.store(ptr + rows[:, None] * row_stride + cols[None, :], tile.to(ptr.dtype.element_ty),
             mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))


@triton.jit
def _visible(query_rows, key_rows, seq_len, window):
    """[queries, keys]: key j is in the sequence and i - window < j <= i."""
    return ((key_rows[None, :] < seq_len) & (key_rows[None, :] <= query_rows[:, None])
            & (key_rows[None, :] > query_rows[:, None] - window))


@triton.jit
def _on_edge(block_start, unmasked_start, unmasked_end):
    """Whether the block starting at block_start needs the window's mask: it lies outside [unmasked_start,
    unmasked_end), the blocks wholly inside every window of the program's rows."""
    return (block_start < unmasked_start) | (block_start >= unmasked_end)


@triton.jit
def _clamp(x, low, high):
    return tl.minimum(tl.maximum(x, low), high)


@triton.jit
def _forward_blocks(acc, row_max, row_sum, q, k_ptr, v_ptr, stride_kn, stride_kd, stride_vn, stride_vd,
                    query_rows, cols, seq_len, head_dim, window, scale_log2, key_start, key_end, unmasked_start,
                    unmasked_end, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr, PRECISION: tl.constexpr):
    for block_start in range(key_start, key_end, BLOCK_N):
        key_rows = block_start + tl.arange(0, BLOCK_N)
        k = _load(k_ptr, key_rows, cols, stride_kn, stride_kd, seq_len, head_dim, PAD_D)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if _on_edge(block_start, unmasked_start, unmasked_end):
            scores = tl.where(_visible(query_rows, key_rows, seq_len, window), scores, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row may see none of a lower-edge block's keys yet (its max stays -inf): subtract 0 there, not -inf.
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        rescale = tl.exp2(row_max - shift)
        probs = tl.exp2(scores - shift[:, None])
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        v = _load(v_ptr, key_rows, cols, stride_vn, stride_vd, seq_len, head_dim, PAD_D)
        acc = tl.dot(probs.to(v.dtype), v, acc * rescale[:, None], input_precision=PRECISION)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def _key_range(query_start, seq_len, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(first, unmasked start, unmasked end, end) of the key blocks a query block [query_start, +BLOCK_M) meets."""
    first = (tl.maximum(query_start - window + 1, 0) // BLOCK_N) * BLOCK_N
    end = tl.minimum(query_start + BLOCK_M, seq_len)
    # Whole blocks inside every query's window: first key > last query - window, last key < first query.
    unmasked_start = _clamp(tl.cdiv(tl.maximum(query_start + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N, first, end)
    unmasked_end = _clamp((query_start // BLOCK_N) * BLOCK_N, unmasked_start, end)
    return first, unmasked_start, unmasked_end, end


@triton.jit
def _forward_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
                    stride_qb, stride_qh, stride_qn, stride_qd,
                    stride_kb, stride_kh, stride_kn, stride_kd,
                    stride_vb, stride_vh, stride_vn, stride_vd,
                    num_heads, seq_len, head_dim, window, scale_log2,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr,
                    PRECISION: tl.constexpr):
    query_start = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    k_ptr += batch * stride_kb + head * stride_kh
    v_ptr += batch * stride_vb + head * stride_vh
    query_rows = query_start + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    q = _load(q_ptr + batch * stride_qb + head * stride_qh, query_rows, cols, stride_qn, stride_qd, seq_len,
              head_dim, PAD_D)
    row_max = tl.full([BLOCK_M], -float("inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first, unmasked_start, unmasked_end, end = _key_range(query_start, seq_len, window, BLOCK_M, BLOCK_N)
    args = (q, k_ptr, v_ptr, stride_kn, stride_kd, stride_vn, stride_vd, query_rows, cols, seq_len, head_dim,
            window, scale_log2)
    acc, row_max, row_sum = _forward_blocks(acc, row_max, row_sum, *args, first, end, unmasked_start, unmasked_end,
                                            BLOCK_N, PAD_D, PRECISION)
    # Every query sees itself, so row_sum >= 1 on the rows that are stored; rows past the end hold 0.
    row_sum = tl.where(row_sum > 0, row_sum, 1.0)
    o = acc / row_sum[:, None]
    _store(o_ptr + batch_head * seq_len * head_dim, o, query_rows, cols, head_dim, seq_len, head_dim)
    lse = (row_max + tl.log2(row_sum)) * _LN_2
    tl.store(lse_ptr + batch_head * seq_len + query_rows, lse, mask=query_rows < seq_len)


@triton.jit
def _prepass_kernel(o_ptr, do_ptr, delta_ptr, stride_dob, stride_doh, stride_don, stride_dod,
                    num_heads, seq_len, head_dim, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    batch_head = tl.program_id(1).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    cols = tl.arange(0, BLOCK_D)
    o = _load(o_ptr + batch_head * seq_len * head_dim, rows, cols, head_dim, 1, seq_len, head_dim, PAD_D)
    do = _load(do_ptr + batch * stride_dob + head * stride_doh, rows, cols, stride_don, stride_dod, seq_len,
               head_dim, PAD_D)
    tl.store(delta_ptr + batch_head * seq_len + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1),
             mask=rows < seq_len)


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qn, stride_qd, stride_don, stride_dod,
                 key_rows, cols, seq_len, head_dim, window, scale_log2, query_start, query_end, unmasked_start,
                 unmasked_end, BLOCK_M: tl.constexpr, PAD_D: tl.constexpr, PRECISION: tl.constexpr):
    for block_start in range(query_start, query_end, BLOCK_M):
        query_rows = block_start + tl.arange(0, BLOCK_M)
        q = _load(q_ptr, query_rows, cols, stride_qn, stride_qd, seq_len, head_dim, PAD_D)
        do = _load(do_ptr, query_rows, cols, stride_don, stride_dod, seq_len, head_dim, PAD_D)
        in_range = query_rows < seq_len
        lse_log2 = tl.load(lse_ptr + query_rows, mask=in_range, other=0.0) * _LOG2_E
        delta = tl.load(delta_ptr + query_rows, mask=in_range, other=0.0)
        probs_t = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale_log2 - lse_log2[None, :])
        if _on_edge(block_start, unmasked_start, unmasked_end):
            probs_t = tl.where(tl.trans(_visible(query_rows, key_rows, seq_len, window)), probs_t, 0.0)
        dv = tl.dot(probs_t.to(do.dtype), do, dv, input_precision=PRECISION)
        grad_scores_t = probs_t * (tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :])
        dk = tl.dot(grad_scores_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                 stride_qb, stride_qh, stride_qn, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_dob, stride_doh, stride_don, stride_dod,
                 num_heads, seq_len, head_dim, window, scale, scale_log2,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr,
                 PRECISION: tl.constexpr):
    key_start = tl.program_id(0) * BLOCK_N
    batch_head = tl.program_id(1).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    q_ptr += batch * stride_qb + head * stride_qh
    do_ptr += batch * stride_dob + head * stride_doh
    lse_ptr += batch_head * seq_len
    delta_ptr += batch_head * seq_len
    key_rows = key_start + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    k = _load(k_ptr + batch * stride_kb + head * stride_kh, key_rows, cols, stride_kn, stride_kd, seq_len, head_dim,
              PAD_D)
    v = _load(v_ptr + batch * stride_vb + head * stride_vh, key_rows, cols, stride_vn, stride_vd, seq_len, head_dim,
              PAD_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # The queries that see key j are j .. j + window - 1.
    first = (key_start // BLOCK_M) * BLOCK_M
    end = tl.minimum(key_start + BLOCK_N + window - 1, seq_len)
    # Whole query blocks that see every key here: first query >= last key, last query < first key + window.
    unmasked_start = _clamp(tl.cdiv(key_start + BLOCK_N, BLOCK_M) * BLOCK_M, first, end)
    unmasked_end = _clamp(tl.minimum((key_start + window) // BLOCK_M, seq_len // BLOCK_M) * BLOCK_M,
                          unmasked_start, end)
    args = (k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qn, stride_qd, stride_don, stride_dod, key_rows, cols,
            seq_len, head_dim, window, scale_log2)
    dk, dv = _dkdv_blocks(dk, dv, *args, first, end, unmasked_start, unmasked_end, BLOCK_M, PAD_D, PRECISION)
    offset = batch_head * seq_len * head_dim
    _store(dk_ptr + offset, dk * scale, key_rows, cols, head_dim, seq_len, head_dim)
    _store(dv_ptr + offset, dv, key_rows, cols, head_dim, seq_len, head_dim)


@triton.jit
def _dq_blocks(dq, q, do, lse_log2, delta, k_ptr, v_ptr, stride_kn, stride_kd, stride_vn, stride_vd, query_rows,
               cols, seq_len, head_dim, window, scale_log2, key_start, key_end, unmasked_start, unmasked_end,
               BLOCK_N: tl.constexpr, PAD_D: tl.constexpr, PRECISION: tl.constexpr):
    for block_start in range(key_start, key_end, BLOCK_N):
        key_rows = block_start + tl.arange(0, BLOCK_N)
        k = _load(k_ptr, key_rows, cols, stride_kn, stride_kd, seq_len, head_dim, PAD_D)
        v = _load(v_ptr, key_rows, cols, stride_vn, stride_vd, seq_len, head_dim, PAD_D)
        probs = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2 - lse_log2[:, None])
        if _on_edge(block_start, unmasked_start, unmasked_end):
            probs = tl.where(_visible(query_rows, key_rows, seq_len, window), probs, 0.0)
        grad_scores = probs * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
        dq = tl.dot(grad_scores.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
               stride_qb, stride_qh, stride_qn, stride_qd,
               stride_kb, stride_kh, stride_kn, stride_kd,
               stride_vb, stride_vh, stride_vn, stride_vd,
               stride_dob, stride_doh, stride_don, stride_dod,
               num_heads, seq_len, head_dim, window, scale, scale_log2,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr,
               PRECISION: tl.constexpr):
    query_start = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    k_ptr += batch * stride_kb + head * stride_kh
    v_ptr += batch * stride_vb + head * stride_vh
    query_rows = query_start + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    in_range = query_rows < seq_len
    q = _load(q_ptr + batch * stride_qb + head * stride_qh, query_rows, cols, stride_qn, stride_qd, seq_len,
              head_dim, PAD_D)
    do = _load(do_ptr + batch * stride_dob + head * stride_doh, query_rows, cols, stride_don, stride_dod, seq_len,
               head_dim, PAD_D)
    lse_log2 = tl.load(lse_ptr + batch_head * seq_len + query_rows, mask=in_range, other=0.0) * _LOG2_E
    delta = tl.load(delta_ptr + batch_head * seq_len + query_rows, mask=in_range, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first, unmasked_start, unmasked_end, end = _key_range(query_start, seq_len, window, BLOCK_M, BLOCK_N)
    args = (q, do, lse_log2, delta, k_ptr, v_ptr, stride_kn, stride_kd, stride_vn, stride_vd, query_rows, cols,
            seq_len, head_dim, window, scale_log2)
    dq = _dq_blocks(dq, *args, first, end, unmasked_start, unmasked_end, BLOCK_N, PAD_D, PRECISION)
    _store(dq_ptr + batch_head * seq_len * head_dim, dq * scale, query_rows, cols, head_dim, seq_len, head_dim)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _forward(q, k, v, window: int):
    batch, heads, seq_len, head_dim = q.shape
    head_dim_block = triton.next_power_of_2(head_dim)
    config = _config(q.dtype, head_dim_block)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    _forward_kernel[(triton.cdiv(seq_len, config["BLOCK_M"]), batch * heads)](
        q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), heads, seq_len, head_dim, window,
        LOG2_E / math.sqrt(head_dim), BLOCK_D=head_dim_block, PAD_D=head_dim_block != head_dim,
        PRECISION=_precision(q.dtype), **config)
    return o, lse


def _backward(q, k, v, o, lse, grad_o, window: int):
    batch, heads, seq_len, head_dim = q.shape
    head_dim_block = triton.next_power_of_2(head_dim)
    pad_d = head_dim_block != head_dim
    scale = 1.0 / math.sqrt(head_dim)
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    _prepass_kernel[(triton.cdiv(seq_len, PREPASS_BLOCK), batch * heads)](
        o, grad_o, delta, *grad_o.stride(), heads, seq_len, head_dim, BLOCK=PREPASS_BLOCK, BLOCK_D=head_dim_block,
        PAD_D=pad_d)
    config = _backward_config(q.dtype, head_dim_block)
    major, minor = config.pop("BLOCK_MAJOR"), config.pop("BLOCK_MINOR")
    grad_q, grad_k, grad_v = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    arguments = (*q.stride(), *k.stride(), *v.stride(), *grad_o.stride(), heads, seq_len, head_dim, window, scale,
                 scale * LOG2_E)
    common = dict(BLOCK_D=head_dim_block, PAD_D=pad_d, PRECISION=_precision(q.dtype), **config)
    _dkdv_kernel[(triton.cdiv(seq_len, major), batch * heads)](
        q, k, v, grad_o, lse, delta, grad_k, grad_v, *arguments, BLOCK_M=minor, BLOCK_N=major, **common)
    _dq_kernel[(triton.cdiv(seq_len, major), batch * heads)](
        q, k, v, grad_o, lse, delta, grad_q, *arguments, BLOCK_M=major, BLOCK_N=minor, **common)
    return grad_q, grad_k, grad_v


class SlidingWindowAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
        o, lse = _forward(q, k, v, window)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.window = window
        return o

    @staticmethod
    def backward(ctx, grad_o: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        return (*_backward(q, k, v, o, lse, grad_o, ctx.window), None)


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Attention over the last `window` keys by the Triton kernels above, differentiable through
    SlidingWindowAttentionFunction."""
    check_arguments(q, k, v, window)
    return SlidingWindowAttentionFunction.apply(q, k, v, window)


def sliding_window_attention_torch(q, k, v, window: int):
    """The plain formula with a [seq, seq] mask: the oracle (run at float64)."""
    seq_len = q.shape[-2]
    i = torch.arange(seq_len, device=q.device)
    visible = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse
