"""Mamba-2's scalar-gated linear attention (the SSD form), chunked, forward and backward in Triton.

For each batch and head, with a log-decay g_t <= 0 per token, the state S_t = exp(g_t) S_{t-1} + k_t v_t^T ([K, V],
float32) is read out as o_t = S_t^T q_t. The sequence is cut into chunks of C tokens; inside chunk c, b_i is the
cumulative sum of g from the chunk's first token to token i, and with S^(c) the state entering the chunk:
    o_i      = exp(b_i) q_i^T S^(c) + sum_{j <= i} (q_i . k_j) exp(b_i - b_j) v_j
    S^(c+1)  = exp(b_L) S^(c) + sum_j exp(b_L - b_j) k_j v_j^T          (L: the chunk's last real token)
Every exponent is <= 0 (the causal mask is applied to b_i - b_j before exponentiating), so nothing overflows however
negative g is, and the per-token log decays never accumulate past one chunk. Each kernel takes b from its own
in-register cumulative sum of the chunk's g, in float64 so that the differences b_i - b_j are exact (see
_chunk_log_decay), and no cumulative sum is stored or read back.

Forward, per (batch, head), N = ceil(T / C) chunks:
  1. _forward_states_kernel: one program per (K block, V block) walks the chunks in order, keeping its block of the
     state in float32 registers; it writes S^(c) before each chunk (in the dtype of the tl.dot operands, its only
     use: bfloat16 for bfloat16 inputs, else float32) and the final state in float32. Reads k (V / BLOCK_V times)
     and v (K / BLOCK_K times), writes N states of K x V.
  2. _forward_output_kernel: one program per (V block, chunk), all independent: the inter-chunk term q S^(c) and
     the intra-chunk scores q k^T (accumulated over K blocks), then the decayed, masked scores times v. Reads q and
     k (V / BLOCK_V times), v and the states once, writes o once.
Backward, with dH^(c) the gradient reaching the state that leaves chunk c (dH^(N-1) = the final state's gradient):
  3. _backward_states_kernel: the mirror of 1, walking the chunks backwards:
     dH^(c-1) = exp(b_L) dH^(c) + sum_i exp(b_i) q_i dO_i^T, and the initial state's gradient at the end. Reads q
     and dO, writes N state gradients.
  4. _backward_dv_kernel, one program per (V block, chunk):
     dv_j = exp(b_L - b_j) dH^(c)^T k_j + sum_{i >= j} (k_j . q_i) exp(b_i - b_j) dO_i.
     Reads q and k (V / BLOCK_V times), dO and the state gradients once, writes dv.
  5. _backward_dqk_kernel, one program per chunk, all of K at once (dg needs whole dot products over K):
     dq_i = exp(b_i) S^(c) dO_i + sum_{j <= i} (dO_i . v_j) exp(b_i - b_j) k_j,
     dk_j = exp(b_L - b_j) dH^(c) v_j + sum_{i >= j} (dO_i . v_j) exp(b_i - b_j) q_i,
     and dg (below). Reads q, k, v, dO, the states and the state gradients once, writes dq, dk and dg.
With the half-precision block sizes below (K = V = 128), per (batch, head), the forward moves about 4 T (K + V)
elements plus 2 N K V state elements, the backward about 8 T K + 6 T V plus 4 N K V: the states weigh as much as the
tokens when K V / C reaches K + V, as at K = V = 128 and C = 64.

dg: with B_t the log decay accumulated over the whole sequence, o and the final state depend on g only through B,
and dg_t = sum_{s >= t} dL/dB_s. Differentiating the closed form gives dL/dB_s = q_s . dq_s - k_s . dk_s, plus
<dS_T, S_T> at s = T. Adding a constant to B_s for every s after chunk c is the same as scaling the state that
leaves chunk c, so the sum of dL/dB over the later chunks is <dH^(c), S^(c+1)>
= exp(b_L) <dH^(c), S^(c)> + sum_j k_j . (exp(b_L - b_j) dH^(c) v_j), all of which kernel 5 holds: dg is a
reverse cumulative sum inside the chunk plus that one number, with no pass over the whole sequence.
"""


import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128)
CHUNK_SIZES = (16, 32, 64)


def check_arguments(q, k, v, g, initial_state=None, chunk_size=None) -> None:
    """The contract's argument checks, shared by the recurrent and the chunked forms (chunk_size None: not given)."""
    for name, tensor in (("q", q), ("k", k), ("v", v), ("g", g)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"mamba2 expects {name} to be a torch.Tensor, got {type(tensor).__name__}")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"mamba2 supports dtypes {SUPPORTED_DTYPES}, got {name} of {tensor.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if g.dtype != torch.float32:
        raise TypeError(f"g must be float32, got {g.dtype}")
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state must be None or a torch.Tensor, got {type(initial_state).__name__}")
        if initial_state.dtype != torch.float32:
            raise TypeError(f"initial_state must be float32, got {initial_state.dtype}")

    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k and v must be [batch, heads, seq, dim], got {q.ndim}-D, {k.ndim}-D and {v.ndim}-D")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v's batch, heads and seq must be q's, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    if 0 in q.shape or 0 in v.shape:
        raise ValueError(f"every dimension must be at least 1, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    batch, heads, seq_len, key_dim = q.shape
    value_dim = v.shape[-1]
    if key_dim not in HEAD_DIMS or value_dim not in HEAD_DIMS:
        raise ValueError(f"K and V must each be one of {HEAD_DIMS}, got K={key_dim} and V={value_dim}")
    if g.shape != (batch, heads, seq_len):
        raise ValueError(f"g must be [batch, heads, seq] = {(batch, heads, seq_len)}, got {tuple(g.shape)}")
    state_shape = (batch, heads, key_dim, value_dim)
    if initial_state is not None and initial_state.shape != state_shape:
        raise ValueError(f"initial_state must be [batch, heads, K, V] = {state_shape}, "
                         f"got {tuple(initial_state.shape)}")
    devices = {t.device for t in (q, k, v, g, initial_state) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, g and initial_state must be on one device, got {sorted(map(str, devices))}")
    if chunk_size is not None and (type(chunk_size) is not int or chunk_size not in CHUNK_SIZES):
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")


def mamba2_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence one token at a time, in plain PyTorch with a float32 state: (o in q's dtype, final state)."""
    check_arguments(q, k, v, g, initial_state)
    batch, heads, seq_len, key_dim = q.shape
    if initial_state is None:
        state = torch.zeros(batch, heads, key_dim, v.shape[-1], dtype=torch.float32, device=q.device)
    else:
        state = initial_state
    outputs = []
    for t in range(seq_len):
        kv = k[:, :, t, :, None].float() * v[:, :, t, None, :].float()
        state = torch.exp(g[:, :, t, None, None]) * state + kv
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t].float(), state))
    return torch.stack(outputs, dim=2).to(q.dtype), state


def _operand_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of every tl.dot operand, and so of the stored chunk-boundary states and their gradients.

    bfloat16 inputs multiply in bfloat16. float16 inputs multiply float32 operands at TF32 precision (see
    _precision), whose 10-bit mantissa is float16's but whose exponent range is float32's: the decayed operands,
    exp(b_i) q_i or exp(b_L - b_j) k_j and the decayed scores, fall far below float16's smallest value (6e-8) under
    strong decay, and flushed to zero they would erase every small gradient, such as dg and the initial state's,
    whose whole size is that of those terms."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs are multiplied in full precision: TF32 would keep only 10 mantissa bits. For float16 inputs,
    # TF32 keeps all of their bits; bfloat16 operands ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


# Block sizes. A sequential kernel (1, 3) runs one chain of N dependent steps per program, so its blocks are small
# enough to give every multiprocessor work; the parallel kernels have N times more programs and take whole rows.
# bfloat16 operands, measured on an H200 (batch 4, 16 heads, 4096 tokens, chunks of 64, each kernel family varied
# alone, forward plus backward): the state blocks are 64 x 32 for K = V = 64 (128 programs; 6% faster than 32 x 32)
# and 64 x 64 for K = V = 128 (4% faster than 64 x 32, 17% than 32 x 32); the output and dv kernels take all of V
# (3% faster than 64 at V = 128); the dq, dk kernel streams V in blocks of 32 (K = 64) or 64 (K = 128) on 4 warps,
# 7% faster at K = 128 than blocks of 32 on 8 warps. float32 operands (float32 and float16 inputs, see
# _operand_dtype) take twice the registers, and float32 inputs multiply without tensor cores: smaller tiles. Under
# the interpreter every block is 16 wide, so that the test shapes (K, V up to 64) still cross several blocks.
def _bfloat16_warps(key_dim: int, value_dim: int) -> int:
    """Warps of the bfloat16 kernels. Four where both widths are 64 or more (measured fastest, above). Below that,
    triton 3.6 on an H200 miscompiled four-warp kernels of this file (wrong values at K = 16, V = 32; K = 32, V = 16;
    K = 64, V = 16 and 32; checked against the float64 recurrence at T = 513); eight gave the right values at every
    pair of widths from 16 to 128 and chunks of 16, 32 and 64."""
    return 4 if min(key_dim, value_dim) >= 64 else 8


def _states_config(dtype: torch.dtype, key_dim: int, value_dim: int) -> dict:
    if triton.knobs.runtime.interpret:
        return dict(BLOCK_K=16, BLOCK_V=16, num_warps=1, num_stages=1)
    if _operand_dtype(dtype) == torch.float32:
        return dict(BLOCK_K=min(key_dim, 32), BLOCK_V=min(value_dim, 32), num_warps=4, num_stages=2)
    return dict(BLOCK_K=min(key_dim, 64), BLOCK_V=min(value_dim, 64 if value_dim > 64 else 32),
                num_warps=_bfloat16_warps(key_dim, value_dim), num_stages=3)


def _output_config(dtype: torch.dtype, key_dim: int, value_dim: int) -> dict:
    """For the forward output kernel and the dv kernel, which share their shape of work."""
    if triton.knobs.runtime.interpret:
        return dict(BLOCK_K=16, BLOCK_V=16, num_warps=1, num_stages=1)
    if _operand_dtype(dtype) == torch.float32:
        return dict(BLOCK_K=min(key_dim, 32), BLOCK_V=min(value_dim, 32), num_warps=4, num_stages=2)
    return dict(BLOCK_K=min(key_dim, 64), BLOCK_V=value_dim, num_warps=_bfloat16_warps(key_dim, value_dim),
                num_stages=2)


def _dqk_config(dtype: torch.dtype, key_dim: int, value_dim: int) -> dict:
    if triton.knobs.runtime.interpret:
        return dict(BLOCK_V=16, num_warps=1, num_stages=1)
    if _operand_dtype(dtype) == torch.float32:
        return dict(BLOCK_V=min(value_dim, 16), num_warps=8, num_stages=1)
    return dict(BLOCK_V=min(value_dim, 64 if key_dim > 64 else 32), num_warps=_bfloat16_warps(key_dim, value_dim),
                num_stages=2)


@triton.jit
def _chunk_log_decay(g_ptr, stride_gt, chunk_start, seq_len, CHUNK: tl.constexpr):
    """(b, b_last), float64: b[i] = g summed over the chunk up to token i, b_last = b at the chunk's last real token.

    Tokens past the sequence read g = 0, so b stays flat there and its last entry is b_last. The sums are float64
    because the kernels exponentiate differences b_i - b_j: in float32 those would carry the rounding error of
    b_i (about |b_i| * 6e-8, |b_i| reaching hundreds under strong decay) into every weight exp(b_i - b_j), even the
    weights of order one between nearby tokens."""
    offsets = tl.arange(0, CHUNK)
    rows = chunk_start + offsets
    g = tl.load(g_ptr + rows * stride_gt, mask=rows < seq_len, other=0.0)
    b = tl.cumsum(g.to(tl.float64), axis=0)
    b_last = tl.sum(tl.where(offsets == CHUNK - 1, b, 0.0), axis=0)
    return b, b_last


@triton.jit
def _exp(log_decay):
    """exp of a float64 log decay, rounded to float32 first."""
    return tl.exp(log_decay.to(tl.float32))


@triton.jit
def _causal_decay(b, TRANSPOSED: tl.constexpr, CHUNK: tl.constexpr):
    """exp(b_i - b_j) where j <= i and 0 elsewhere, as [i, j] (or [j, i] when TRANSPOSED); exponents are <= 0."""
    offsets = tl.arange(0, CHUNK)
    if TRANSPOSED:
        exponent = tl.where(offsets[:, None] <= offsets[None, :], b[None, :] - b[:, None], -float("inf"))
    else:
        exponent = tl.where(offsets[None, :] <= offsets[:, None], b[:, None] - b[None, :], -float("inf"))
    return _exp(exponent)


@triton.jit
def _load_tile(ptr, rows, cols, row_stride, col_stride, seq_len):
    """Tile [len(rows), len(cols)] of a sequence-major operand; rows past the sequence read as 0."""
    return tl.load(ptr + rows[:, None] * row_stride + cols[None, :] * col_stride, mask=rows[:, None] < seq_len,
                   other=0.0)


@triton.jit
def _load_tile_t(ptr, rows, cols, row_stride, col_stride, seq_len):
    """The same tile transposed, [len(cols), len(rows)]."""
    return tl.load(ptr + rows[None, :] * row_stride + cols[:, None] * col_stride, mask=rows[None, :] < seq_len,
                   other=0.0)


@triton.jit
def _forward_states_kernel(k_ptr, v_ptr, g_ptr, initial_ptr, states_ptr, final_ptr,
                           stride_kb, stride_kh, stride_kt, stride_kd,
                           stride_vb, stride_vh, stride_vt, stride_vd,
                           stride_gb, stride_gh, stride_gt,
                           stride_ib, stride_ih, stride_ik, stride_iv,
                           num_heads, seq_len, num_chunks,
                           KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, HAS_INITIAL: tl.constexpr,
                           CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                           PRECISION: tl.constexpr):
    # One program per (K block, V block, batch*head). states is contiguous [batch*heads, num_chunks, K, V],
    # final contiguous [batch*heads, K, V].
    key_cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    value_cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    batch_head = tl.program_id(2).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    k_ptr += batch * stride_kb + head * stride_kh
    v_ptr += batch * stride_vb + head * stride_vh
    g_ptr += batch * stride_gb + head * stride_gh
    block = key_cols[:, None] * VALUE_DIM + value_cols[None, :]
    states_ptr += batch_head * num_chunks * KEY_DIM * VALUE_DIM + block
    operand = states_ptr.dtype.element_ty  # what every tl.dot multiplies (see _operand_dtype)
    if HAS_INITIAL:
        initial_ptr += batch * stride_ib + head * stride_ih
        state = tl.load(initial_ptr + key_cols[:, None] * stride_ik + value_cols[None, :] * stride_iv)
    else:
        state = tl.zeros([BLOCK_K, BLOCK_V], tl.float32)

    for chunk in range(num_chunks):
        tl.store(states_ptr + chunk * KEY_DIM * VALUE_DIM, state.to(operand))
        rows = chunk * CHUNK + tl.arange(0, CHUNK)
        b, b_last = _chunk_log_decay(g_ptr, stride_gt, chunk * CHUNK, seq_len, CHUNK)
        k_t = _load_tile_t(k_ptr, rows, key_cols, stride_kt, stride_kd, seq_len)
        v = _load_tile(v_ptr, rows, value_cols, stride_vt, stride_vd, seq_len).to(operand)
        # Each key decays from its own token to the chunk's end; the old state over the whole chunk.
        k_t = (k_t * _exp(b_last - b)[None, :]).to(operand)
        state = tl.dot(k_t, v, state * _exp(b_last), input_precision=PRECISION)

    tl.store(final_ptr + batch_head * KEY_DIM * VALUE_DIM + block, state)


@triton.jit
def _forward_output_kernel(q_ptr, k_ptr, v_ptr, g_ptr, states_ptr, o_ptr,
                           stride_qb, stride_qh, stride_qt, stride_qd,
                           stride_kb, stride_kh, stride_kt, stride_kd,
                           stride_vb, stride_vh, stride_vt, stride_vd,
                           stride_gb, stride_gh, stride_gt,
                           num_heads, seq_len, num_chunks,
                           KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, CHUNK: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr):
    # One program per (V block, chunk, batch*head); o is contiguous [batch*heads, seq, V].
    value_cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    chunk = tl.program_id(1)
    batch_head = tl.program_id(2).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    q_ptr += batch * stride_qb + head * stride_qh
    k_ptr += batch * stride_kb + head * stride_kh
    states_ptr += (batch_head * num_chunks + chunk) * KEY_DIM * VALUE_DIM
    operand = states_ptr.dtype.element_ty
    rows = chunk * CHUNK + tl.arange(0, CHUNK)
    b, _ = _chunk_log_decay(g_ptr + batch * stride_gb + head * stride_gh, stride_gt, chunk * CHUNK, seq_len, CHUNK)

    inter = tl.zeros([CHUNK, BLOCK_V], tl.float32)
    scores = tl.zeros([CHUNK, CHUNK], tl.float32)
    for key_start in range(0, KEY_DIM, BLOCK_K):
        key_cols = key_start + tl.arange(0, BLOCK_K)
        q = _load_tile(q_ptr, rows, key_cols, stride_qt, stride_qd, seq_len).to(operand)
        k = _load_tile(k_ptr, rows, key_cols, stride_kt, stride_kd, seq_len).to(operand)
        state = tl.load(states_ptr + key_cols[:, None] * VALUE_DIM + value_cols[None, :])
        inter = tl.dot(q, state, inter, input_precision=PRECISION)
        scores = tl.dot(q, tl.trans(k), scores, input_precision=PRECISION)

    v = _load_tile(v_ptr + batch * stride_vb + head * stride_vh, rows, value_cols, stride_vt, stride_vd, seq_len)
    scores = (scores * _causal_decay(b, False, CHUNK)).to(operand)
    o = tl.dot(scores, v.to(operand), inter * _exp(b)[:, None], input_precision=PRECISION)
    o_ptrs = o_ptr + batch_head * seq_len * VALUE_DIM + rows[:, None] * VALUE_DIM + value_cols[None, :]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=rows[:, None] < seq_len)


@triton.jit
def _backward_states_kernel(q_ptr, do_ptr, g_ptr, final_grad_ptr, grad_states_ptr, initial_grad_ptr,
                            stride_qb, stride_qh, stride_qt, stride_qd,
                            stride_ob, stride_oh, stride_ot, stride_od,
                            stride_gb, stride_gh, stride_gt,
                            stride_fb, stride_fh, stride_fk, stride_fv,
                            num_heads, seq_len, num_chunks,
                            KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, HAS_FINAL_GRAD: tl.constexpr,
                            HAS_INITIAL: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
                            BLOCK_V: tl.constexpr, PRECISION: tl.constexpr):
    # One program per (K block, V block, batch*head). grad_states[c] is the gradient reaching the state that leaves
    # chunk c, contiguous [batch*heads, num_chunks, K, V]; initial_grad is contiguous [batch*heads, K, V].
    key_cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    value_cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    batch_head = tl.program_id(2).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    q_ptr += batch * stride_qb + head * stride_qh
    do_ptr += batch * stride_ob + head * stride_oh
    g_ptr += batch * stride_gb + head * stride_gh
    block = key_cols[:, None] * VALUE_DIM + value_cols[None, :]
    grad_states_ptr += batch_head * num_chunks * KEY_DIM * VALUE_DIM + block
    operand = grad_states_ptr.dtype.element_ty
    if HAS_FINAL_GRAD:
        final_grad_ptr += batch * stride_fb + head * stride_fh
        grad = tl.load(final_grad_ptr + key_cols[:, None] * stride_fk + value_cols[None, :] * stride_fv)
    else:
        grad = tl.zeros([BLOCK_K, BLOCK_V], tl.float32)

    for step in range(num_chunks):
        chunk = num_chunks - 1 - step
        tl.store(grad_states_ptr + chunk * KEY_DIM * VALUE_DIM, grad.to(operand))
        rows = chunk * CHUNK + tl.arange(0, CHUNK)
        b, b_last = _chunk_log_decay(g_ptr, stride_gt, chunk * CHUNK, seq_len, CHUNK)
        q_t = _load_tile_t(q_ptr, rows, key_cols, stride_qt, stride_qd, seq_len)
        do = _load_tile(do_ptr, rows, value_cols, stride_ot, stride_od, seq_len).to(operand)
        # o_i reads the entering state through exp(b_i); the leaving state holds it times exp(b_last).
        q_t = (q_t * _exp(b)[None, :]).to(operand)
        grad = tl.dot(q_t, do, grad * _exp(b_last), input_precision=PRECISION)

    if HAS_INITIAL:
        tl.store(initial_grad_ptr + batch_head * KEY_DIM * VALUE_DIM + block, grad)


@triton.jit
def _backward_dv_kernel(q_ptr, k_ptr, do_ptr, g_ptr, grad_states_ptr, dv_ptr,
                        stride_qb, stride_qh, stride_qt, stride_qd,
                        stride_kb, stride_kh, stride_kt, stride_kd,
                        stride_ob, stride_oh, stride_ot, stride_od,
                        stride_gb, stride_gh, stride_gt,
                        num_heads, seq_len, num_chunks,
                        KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr):
    # One program per (V block, chunk, batch*head); dv is contiguous [batch*heads, seq, V]. Keys are rows here.
    value_cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    chunk = tl.program_id(1)
    batch_head = tl.program_id(2).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    q_ptr += batch * stride_qb + head * stride_qh
    k_ptr += batch * stride_kb + head * stride_kh
    grad_states_ptr += (batch_head * num_chunks + chunk) * KEY_DIM * VALUE_DIM
    operand = grad_states_ptr.dtype.element_ty
    rows = chunk * CHUNK + tl.arange(0, CHUNK)
    b, b_last = _chunk_log_decay(g_ptr + batch * stride_gb + head * stride_gh, stride_gt, chunk * CHUNK, seq_len,
                                 CHUNK)

    inter = tl.zeros([CHUNK, BLOCK_V], tl.float32)
    scores_t = tl.zeros([CHUNK, CHUNK], tl.float32)
    for key_start in range(0, KEY_DIM, BLOCK_K):
        key_cols = key_start + tl.arange(0, BLOCK_K)
        k = _load_tile(k_ptr, rows, key_cols, stride_kt, stride_kd, seq_len).to(operand)
        q = _load_tile(q_ptr, rows, key_cols, stride_qt, stride_qd, seq_len).to(operand)
        grad_state = tl.load(grad_states_ptr + key_cols[:, None] * VALUE_DIM + value_cols[None, :])
        inter = tl.dot(k, grad_state, inter, input_precision=PRECISION)
        scores_t = tl.dot(k, tl.trans(q), scores_t, input_precision=PRECISION)

    do = _load_tile(do_ptr + batch * stride_ob + head * stride_oh, rows, value_cols, stride_ot, stride_od, seq_len)
    scores_t = (scores_t * _causal_decay(b, True, CHUNK)).to(operand)
    dv = tl.dot(scores_t, do.to(operand), inter * _exp(b_last - b)[:, None], input_precision=PRECISION)
    dv_ptrs = dv_ptr + batch_head * seq_len * VALUE_DIM + rows[:, None] * VALUE_DIM + value_cols[None, :]
    tl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=rows[:, None] < seq_len)


@triton.jit
def _backward_dqk_kernel(q_ptr, k_ptr, v_ptr, do_ptr, g_ptr, states_ptr, grad_states_ptr, dq_ptr, dk_ptr, dg_ptr,
                         stride_qb, stride_qh, stride_qt, stride_qd,
                         stride_kb, stride_kh, stride_kt, stride_kd,
                         stride_vb, stride_vh, stride_vt, stride_vd,
                         stride_ob, stride_oh, stride_ot, stride_od,
                         stride_gb, stride_gh, stride_gt,
                         num_heads, seq_len, num_chunks,
                         KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCK_V: tl.constexpr, PRECISION: tl.constexpr):
    # One program per (chunk, batch*head), holding all K columns; dq and dk are contiguous [batch*heads, seq, K],
    # dg contiguous [batch*heads, seq].
    chunk = tl.program_id(0)
    batch_head = tl.program_id(1).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    v_ptr += batch * stride_vb + head * stride_vh
    do_ptr += batch * stride_ob + head * stride_oh
    state_offset = (batch_head * num_chunks + chunk) * KEY_DIM * VALUE_DIM
    states_ptr += state_offset
    grad_states_ptr += state_offset
    operand = states_ptr.dtype.element_ty
    rows = chunk * CHUNK + tl.arange(0, CHUNK)
    key_cols = tl.arange(0, KEY_DIM)
    b, b_last = _chunk_log_decay(g_ptr + batch * stride_gb + head * stride_gh, stride_gt, chunk * CHUNK, seq_len,
                                 CHUNK)

    dq = tl.zeros([CHUNK, KEY_DIM], tl.float32)
    dk = tl.zeros([CHUNK, KEY_DIM], tl.float32)
    grad_scores = tl.zeros([CHUNK, CHUNK], tl.float32)
    state_product = tl.zeros([KEY_DIM], tl.float32)
    for value_start in range(0, VALUE_DIM, BLOCK_V):
        value_cols = value_start + tl.arange(0, BLOCK_V)
        do = _load_tile(do_ptr, rows, value_cols, stride_ot, stride_od, seq_len).to(operand)
        v = _load_tile(v_ptr, rows, value_cols, stride_vt, stride_vd, seq_len).to(operand)
        block = key_cols[:, None] * VALUE_DIM + value_cols[None, :]
        state = tl.load(states_ptr + block)
        grad_state = tl.load(grad_states_ptr + block)
        dq = tl.dot(do, tl.trans(state), dq, input_precision=PRECISION)
        dk = tl.dot(v, tl.trans(grad_state), dk, input_precision=PRECISION)
        grad_scores = tl.dot(do, tl.trans(v), grad_scores, input_precision=PRECISION)
        state_product += tl.sum(state.to(tl.float32) * grad_state.to(tl.float32), axis=1)

    q = _load_tile(q_ptr + batch * stride_qb + head * stride_qh, rows, key_cols, stride_qt, stride_qd, seq_len)
    k = _load_tile(k_ptr + batch * stride_kb + head * stride_kh, rows, key_cols, stride_kt, stride_kd, seq_len)
    q, k = q.to(operand), k.to(operand)
    q32, k32 = q.to(tl.float32), k.to(tl.float32)
    grad_scores *= _causal_decay(b, False, CHUNK)
    # The diagonal term (dO_i . v_i) adds the same (q_i . k_i)(dO_i . v_i) to q_i . dq_i and to k_i . dk_i. dg
    # takes their difference, so it is left out of both before the products, added to dq and dk after: when the
    # decay is strong it would dwarf, then cancel from, the terms that make up dg.
    offsets = tl.arange(0, CHUNK)
    diagonal = tl.sum(tl.where(offsets[:, None] == offsets[None, :], grad_scores, 0.0), axis=1)
    grad_scores = tl.where(offsets[None, :] < offsets[:, None], grad_scores, 0.0).to(operand)
    dq = tl.dot(grad_scores, k, dq * _exp(b)[:, None], input_precision=PRECISION)
    dk_intra = tl.dot(tl.trans(grad_scores), q, input_precision=PRECISION)
    dk_inter = dk * _exp(b_last - b)[:, None]

    # dg_t = sum_{s >= t} dL/dB_s (module docstring). The terms of dk_inter belong to tokens s >= t but add up to
    # sum_j k_j . dk_inter_j inside <dH^(c), S^(c+1)>; what is left of them is the sum over j < t, which is taken
    # as such, not as a difference of two sums, so that a large k_j . dk_inter_j at j = t cannot cancel.
    grad_log_decay = tl.sum(q32 * dq, axis=1) - tl.sum(k32 * dk_intra, axis=1)
    inter_terms = tl.sum(k32 * dk_inter, axis=1)
    later_token = offsets[None, :] >= offsets[:, None]
    dg = tl.sum(tl.where(later_token, grad_log_decay[None, :], inter_terms[None, :]), axis=1)
    dg += _exp(b_last) * tl.sum(state_product, axis=0)
    dq += diagonal[:, None] * k32
    dk = dk_intra + dk_inter + diagonal[:, None] * q32

    in_seq = rows < seq_len
    offsets = batch_head * seq_len * KEY_DIM + rows[:, None] * KEY_DIM + key_cols[None, :]
    tl.store(dq_ptr + offsets, dq.to(dq_ptr.dtype.element_ty), mask=in_seq[:, None])
    tl.store(dk_ptr + offsets, dk.to(dk_ptr.dtype.element_ty), mask=in_seq[:, None])
    tl.store(dg_ptr + batch_head * seq_len + rows, dg, mask=in_seq)


def _forward(q, k, v, g, initial_state, chunk_size: int):
    batch, heads, seq_len, key_dim = q.shape
    value_dim = v.shape[-1]
    num_chunks = triton.cdiv(seq_len, chunk_size)
    common = dict(KEY_DIM=key_dim, VALUE_DIM=value_dim, CHUNK=chunk_size, PRECISION=_precision(q.dtype))
    has_initial = initial_state is not None
    # The states are tl.dot operands only, so they are kept in the operands' dtype; the final state is float32.
    states = torch.empty(batch * heads, num_chunks, key_dim, value_dim, dtype=_operand_dtype(q.dtype),
                         device=q.device)
    final_state = torch.empty(batch, heads, key_dim, value_dim, dtype=torch.float32, device=q.device)
    config = _states_config(q.dtype, key_dim, value_dim)
    grid = (key_dim // config["BLOCK_K"], value_dim // config["BLOCK_V"], batch * heads)
    _forward_states_kernel[grid](
        k, v, g, initial_state if has_initial else final_state, states, final_state,
        *k.stride(), *v.stride(), *g.stride(), *(initial_state.stride() if has_initial else (0, 0, 0, 0)),
        heads, seq_len, num_chunks, HAS_INITIAL=has_initial, **common, **config,
    )
    o = torch.empty(batch, heads, seq_len, value_dim, dtype=q.dtype, device=q.device)
    config = _output_config(q.dtype, key_dim, value_dim)
    grid = (value_dim // config["BLOCK_V"], num_chunks, batch * heads)
    _forward_output_kernel[grid](
        q, k, v, g, states, o, *q.stride(), *k.stride(), *v.stride(), *g.stride(),
        heads, seq_len, num_chunks, **common, **config,
    )
    return o, final_state, states


def _backward(q, k, v, g, states, grad_o, grad_final, has_initial: bool, chunk_size: int):
    batch, heads, seq_len, key_dim = q.shape
    value_dim = v.shape[-1]
    num_chunks = states.shape[1]
    common = dict(KEY_DIM=key_dim, VALUE_DIM=value_dim, CHUNK=chunk_size, PRECISION=_precision(q.dtype))
    has_final_grad = grad_final is not None
    grad_states = torch.empty_like(states)
    grad_initial = torch.empty(batch, heads, key_dim, value_dim, dtype=torch.float32, device=q.device)
    config = _states_config(q.dtype, key_dim, value_dim)
    grid = (key_dim // config["BLOCK_K"], value_dim // config["BLOCK_V"], batch * heads)
    _backward_states_kernel[grid](
        q, grad_o, g, grad_final if has_final_grad else grad_initial, grad_states, grad_initial,
        *q.stride(), *grad_o.stride(), *g.stride(), *(grad_final.stride() if has_final_grad else (0, 0, 0, 0)),
        heads, seq_len, num_chunks, HAS_FINAL_GRAD=has_final_grad, HAS_INITIAL=has_initial, **common, **config,
    )
    grad_v = torch.empty(batch, heads, seq_len, value_dim, dtype=v.dtype, device=v.device)
    config = _output_config(q.dtype, key_dim, value_dim)
    grid = (value_dim // config["BLOCK_V"], num_chunks, batch * heads)
    _backward_dv_kernel[grid](
        q, k, grad_o, g, grad_states, grad_v, *q.stride(), *k.stride(), *grad_o.stride(), *g.stride(),
        heads, seq_len, num_chunks, **common, **config,
    )
    grad_q = torch.empty(batch, heads, seq_len, key_dim, dtype=q.dtype, device=q.device)
    grad_k = torch.empty(batch, heads, seq_len, key_dim, dtype=k.dtype, device=k.device)
    grad_g = torch.empty(batch, heads, seq_len, dtype=torch.float32, device=g.device)
    _backward_dqk_kernel[(num_chunks, batch * heads)](
        q, k, v, grad_o, g, states, grad_states, grad_q, grad_k, grad_g,
        *q.stride(), *k.stride(), *v.stride(), *grad_o.stride(), *g.stride(),
        heads, seq_len, num_chunks, **common, **_dqk_config(q.dtype, key_dim, value_dim),
    )
    return grad_q, grad_k, grad_v, grad_g, grad_initial if has_initial else None


class Mamba2Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                initial_state: torch.Tensor | None, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        o, final_state, states = _forward(q, k, v, g, initial_state, chunk_size)
        ctx.save_for_backward(q, k, v, g, states)
        ctx.has_initial = initial_state is not None
        ctx.chunk_size = chunk_size
        # A gradient that does not reach an output arrives as None, not as a tensor of zeros to read.
        ctx.set_materialize_grads(False)
        return o, final_state

    @staticmethod
    def backward(ctx, grad_o: torch.Tensor | None, grad_final_state: torch.Tensor | None):
        q, k, v, g, states = ctx.saved_tensors
        if grad_o is None:
            grad_o = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
        grads = _backward(q, k, v, g, states, grad_o, grad_final_state, ctx.has_initial, ctx.chunk_size)
        return *grads, None


def mamba2_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   initial_state: torch.Tensor | None = None, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan by the Triton kernels above, differentiable through Mamba2Function."""
    check_arguments(q, k, v, g, initial_state, chunk_size)
    return Mamba2Function.apply(q, k, v, g, initial_state, chunk_size)
