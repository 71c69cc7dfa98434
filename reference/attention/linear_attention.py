"""Causal linear attention with the feature map elu + 1 and no normaliser: two plain PyTorch forms and a chunked
Triton form, forward and backward.

Per (batch, head), with phi(x) = elu(x) + 1 applied elementwise to the rows of Q and K,
    S_t = S_{t-1} + phi(k_t) v_t^T  (S_0 = 0),    o_t = S_t^T phi(q_t),
that is O = (phi(Q) phi(K)^T * M) V with M the causal mask (key j visible to query i iff j <= i).

Chunked form. The tokens are cut into N = ceil(T / C) chunks of C; S_c is the state before chunk c, the sum of
phi(k) v^T over the earlier chunks. Writing Q', K' for phi(Q), phi(K) and A = Q'_c K'_c^T * M for the masked scores
inside chunk c, the outputs are O_c = Q'_c S_c + A V_c. The backward needs the mirror state dS_c, the sum of
Q'^T dO over the later chunks, and dA = dO_c V_c^T * M:
    dQ'_c = dO_c S_c^T + dA K'_c,    dK'_c = V_c dS_c^T + dA^T Q'_c,    dV_c = K'_c dS_c + A^T dO_c,
then dq = dQ' * phi'(q) and dk = dK' * phi'(k), with phi'(x) = 1 above 0 and exp(x) at or below.

Kernels, per (batch, head), with e bytes an element and D = K = V for the counts:
  _states_kernel: one program per (block of the [X, Y] state, batch*head), walking the chunks in order (forward:
      X = K, Y = V, giving every S_c) or in reverse (backward: X = Q, Y = dO, giving every dS_c). It reads X and Y
      about once from HBM (the programs of one head are neighbours in the grid and walk the chunks in step, so the
      D / BLOCK re-reads of each row mostly hit L2), and writes the N states, N D^2 e = T D e (D / C) bytes: twice
      the bytes of Q at D = 128, C = 64.
  _output_kernel: one program per (block of V columns, chunk, batch*head); reads V and S_c once, Q and K once per
      block of V columns (once in half precision, where the block is all of V), writes O once.
  _gradient_kernel: one program per (chunk, batch*head); reads Q, K, V, dO, S_c and dS_c once (and Q, K again from
      L2 for phi'), writes dQ, dK, dV once.
The boundary states are saved for backward, so the backward never rebuilds them. The states are kept in the input
dtype: they are used only as tl.dot operands, which may be rounded to that dtype anyway, and this halves their
traffic in half precision. Every product and sum accumulates in float32; float32 inputs multiply in full precision.
All parallelism over T is in the chunk kernels; the state passes are sequential over N chunks of cheap steps.
"""


import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128)
CHUNK_SIZES = (16, 32, 64)


def check_arguments(q, k, v, chunk_size=None) -> None:
    """The contract's argument checks, shared by the three forms; chunk_size is checked unless it is None."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"linear attention expects {name} to be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"linear attention supports dtypes {SUPPORTED_DTYPES}, got {name} of {tensor.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.ndim != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, dim], got shape {tuple(tensor.shape)}")
    if not q.shape[:3] == k.shape[:3] == v.shape[:3]:
        raise ValueError(f"q, k and v must share batch, heads and seq, got {tuple(q.shape)}, {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"q and k must share their last dimension, got {tuple(q.shape)} and {tuple(k.shape)}")
    if 0 in q.shape or 0 in v.shape:
        raise ValueError(f"every dimension must be at least 1, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    if q.shape[3] not in HEAD_DIMS or v.shape[3] not in HEAD_DIMS:
        raise ValueError(f"the key and value dimensions must be in {HEAD_DIMS}, got {q.shape[3]} and {v.shape[3]}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")
    if chunk_size is not None and (type(chunk_size) is not int or chunk_size not in CHUNK_SIZES):
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")


def _feature_map(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.elu(x) + 1.0


def linear_attention_parallel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(phi(Q) phi(K)^T * M) V with the T x T matrix of scores written out, in float32; o in q's dtype."""
    check_arguments(q, k, v)
    seq_len = q.shape[2]
    scores = _feature_map(q.float()) @ _feature_map(k.float()).transpose(-1, -2)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
    return (scores.masked_fill(~causal, 0.0) @ v.float()).to(q.dtype)


def linear_attention_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The recurrence token by token with a float32 state [batch, heads, K, V]; o in q's dtype."""
    check_arguments(q, k, v)
    batch, heads, seq_len, key_dim = q.shape
    features_q, features_k, values = _feature_map(q.float()), _feature_map(k.float()), v.float()
    state = torch.zeros(batch, heads, key_dim, v.shape[3], dtype=torch.float32, device=q.device)
    outputs = []
    for t in range(seq_len):
        state = state + features_k[:, :, t, :, None] * values[:, :, t, None, :]
        outputs.append((features_q[:, :, t, None, :] @ state).squeeze(-2))
    return torch.stack(outputs, dim=2).to(q.dtype)


# Tile shapes. The state passes keep one [BLOCK_X, BLOCK_Y] float32 block of the state per program. The output
# kernel walks the key dimension in BLOCK_K columns for one block of BLOCK_V value columns (all of V in half
# precision), accumulating both of its products per block of keys. The gradient kernel holds whole rows of Q and K
# (K <= 128) and walks the value dimension in BLOCK_V columns. Under the interpreter the blocks are the smallest
# tl.dot takes, so that the short test dimensions still cross several blocks.
def _states_config(dtype: torch.dtype, key_dim: int, value_dim: int) -> dict:
    if triton.knobs.runtime.interpret:
        return dict(BLOCK_X=16, BLOCK_Y=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_X=min(key_dim, 32), BLOCK_Y=min(value_dim, 32), num_warps=4, num_stages=2)
    return dict(BLOCK_X=min(key_dim, 64), BLOCK_Y=min(value_dim, 64), num_warps=4, num_stages=2)


def _output_config(dtype: torch.dtype, key_dim: int, value_dim: int) -> dict:
    if triton.knobs.runtime.interpret:
        return dict(BLOCK_K=16, BLOCK_V=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_K=min(key_dim, 32), BLOCK_V=min(value_dim, 32), num_warps=4, num_stages=2)
    # Eight warps: at four, triton 3.6 on Hopper miscompiled this kernel in half precision (K = 32, V = 16 and
    # K = 64, V = 32 read shared memory out of bounds), and two or eight gave the right values.
    return dict(BLOCK_K=min(key_dim, 64), BLOCK_V=value_dim, num_warps=8, num_stages=2)


def _gradient_config(dtype: torch.dtype, key_dim: int, value_dim: int) -> dict:
    if triton.knobs.runtime.interpret:
        return dict(BLOCK_V=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_V=min(value_dim, 32), num_warps=8, num_stages=1)
    return dict(BLOCK_V=min(value_dim, 64), num_warps=4 if key_dim <= 64 else 8, num_stages=2)


def _precision(dtype: torch.dtype) -> str:
    # float32 operands are multiplied in full precision: TF32 would keep only 10 mantissa bits. The setting does
    # not affect float16 and bfloat16 operands.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _feature_map_kernel(x):
    """phi(x) = elu(x) + 1 in float32: x + 1 above 0, exp(x) at or below (the exponent is clamped so that the branch
    not taken never overflows)."""
    x = x.to(tl.float32)
    return tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))


@triton.jit
def _feature_slope(x):
    """phi'(x) in float32: 1 above 0, exp(x) at or below."""
    x = x.to(tl.float32)
    return tl.where(x > 0, 1.0, tl.exp(tl.minimum(x, 0.0)))


@triton.jit
def _load_rows(ptr, rows, cols, row_stride, col_stride, seq_len):
    """Tile [len(rows), len(cols)] of a [seq, dim] matrix; rows past seq_len read as 0."""
    return tl.load(ptr + rows[:, None] * row_stride + cols[None, :] * col_stride, mask=rows[:, None] < seq_len,
                   other=0.0)


@triton.jit
def _states_kernel(x_ptr, y_ptr, states_ptr,
                   stride_xb, stride_xh, stride_xt, stride_xd,
                   stride_yb, stride_yh, stride_yt, stride_yd,
                   num_heads, seq_len, num_chunks,
                   X_DIM: tl.constexpr, Y_DIM: tl.constexpr, REVERSE: tl.constexpr, CHUNK: tl.constexpr,
                   BLOCK_X: tl.constexpr, BLOCK_Y: tl.constexpr, PRECISION: tl.constexpr):
    """states[c] = sum of phi(X_j)^T Y_j over the chunks j before c (after c if REVERSE), for one block of columns.

    states is contiguous [batch*heads, num_chunks, X_DIM, Y_DIM] in the inputs' dtype; the running sum is float32.
    """
    blocks_y: tl.constexpr = Y_DIM // BLOCK_Y
    x_cols = (tl.program_id(0) // blocks_y) * BLOCK_X + tl.arange(0, BLOCK_X)
    y_cols = (tl.program_id(0) % blocks_y) * BLOCK_Y + tl.arange(0, BLOCK_Y)
    batch_head = tl.program_id(1).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    x_ptr += batch * stride_xb + head * stride_xh
    y_ptr += batch * stride_yb + head * stride_yh
    states_ptr += batch_head * num_chunks * X_DIM * Y_DIM + x_cols[:, None] * Y_DIM + y_cols[None, :]

    state = tl.zeros([BLOCK_X, BLOCK_Y], tl.float32)
    for step in range(num_chunks):
        if REVERSE:
            chunk = num_chunks - 1 - step
        else:
            chunk = step
        tl.store(states_ptr + chunk * X_DIM * Y_DIM, state.to(states_ptr.dtype.element_ty))
        rows = chunk * CHUNK + tl.arange(0, CHUNK)
        y = _load_rows(y_ptr, rows, y_cols, stride_yt, stride_yd, seq_len)
        # Rows past the sequence have phi(0) = 1 but y = 0: they add nothing.
        x = _feature_map_kernel(_load_rows(x_ptr, rows, x_cols, stride_xt, stride_xd, seq_len)).to(y.dtype)
        state = tl.dot(tl.trans(x), y, state, input_precision=PRECISION)


@triton.jit
def _output_kernel(q_ptr, k_ptr, v_ptr, states_ptr, o_ptr,
                   stride_qb, stride_qh, stride_qt, stride_qd,
                   stride_kb, stride_kh, stride_kt, stride_kd,
                   stride_vb, stride_vh, stride_vt, stride_vd,
                   num_heads, seq_len, num_chunks,
                   KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, CHUNK: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr):
    """O_c = Q'_c S_c + (Q'_c K'_c^T * M) V_c for one chunk and one block of value columns; o is contiguous
    [batch, heads, seq, VALUE_DIM]. The key dimension is walked in BLOCK_K columns, adding to Q'_c S_c and to the
    scores together."""
    value_cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    chunk = tl.program_id(1)
    batch_head = tl.program_id(2).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    q_ptr += batch * stride_qb + head * stride_qh
    k_ptr += batch * stride_kb + head * stride_kh
    states_ptr += (batch_head * num_chunks + chunk) * KEY_DIM * VALUE_DIM
    dtype = v_ptr.dtype.element_ty
    rows = chunk * CHUNK + tl.arange(0, CHUNK)

    inter = tl.zeros([CHUNK, BLOCK_V], tl.float32)
    scores = tl.zeros([CHUNK, CHUNK], tl.float32)
    for key_start in range(0, KEY_DIM, BLOCK_K):
        key_cols = key_start + tl.arange(0, BLOCK_K)
        q = _feature_map_kernel(_load_rows(q_ptr, rows, key_cols, stride_qt, stride_qd, seq_len)).to(dtype)
        k = _feature_map_kernel(_load_rows(k_ptr, rows, key_cols, stride_kt, stride_kd, seq_len)).to(dtype)
        state = tl.load(states_ptr + key_cols[:, None] * VALUE_DIM + value_cols[None, :])
        inter = tl.dot(q, state, inter, input_precision=PRECISION)
        scores = tl.dot(q, tl.trans(k), scores, input_precision=PRECISION)

    # Padding rows past the sequence meet v = 0 as keys and are never stored as queries: only causality is masked.
    causal = tl.arange(0, CHUNK)[None, :] <= tl.arange(0, CHUNK)[:, None]
    scores = tl.where(causal, scores, 0.0).to(dtype)
    v = _load_rows(v_ptr + batch * stride_vb + head * stride_vh, rows, value_cols, stride_vt, stride_vd, seq_len)
    o = tl.dot(scores, v, inter, input_precision=PRECISION)
    o_ptrs = o_ptr + (batch_head * seq_len + rows[:, None]) * VALUE_DIM + value_cols[None, :]
    tl.store(o_ptrs, o.to(dtype), mask=rows[:, None] < seq_len)


@triton.jit
def _gradient_kernel(q_ptr, k_ptr, v_ptr, do_ptr, states_ptr, grad_states_ptr, dq_ptr, dk_ptr, dv_ptr,
                     stride_qb, stride_qh, stride_qt, stride_qd,
                     stride_kb, stride_kh, stride_kt, stride_kd,
                     stride_vb, stride_vh, stride_vt, stride_vd,
                     stride_dob, stride_doh, stride_dot, stride_dod,
                     num_heads, seq_len, num_chunks,
                     KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_V: tl.constexpr,
                     PRECISION: tl.constexpr):
    """dQ, dK, dV of one chunk from S_c and dS_c; the gradients are contiguous [batch, heads, seq, dim].

    The value dimension is walked in BLOCK_V columns: each block adds its share to dA = dO V^T, dQ' (dO S^T) and dK'
    (V dS^T) and finishes its columns of dV (K' dS + A^T dO); the dA terms of dQ' and dK' come after the walk.
    """
    chunk = tl.program_id(0)
    batch_head = tl.program_id(1).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    q_ptr += batch * stride_qb + head * stride_qh
    k_ptr += batch * stride_kb + head * stride_kh
    v_ptr += batch * stride_vb + head * stride_vh
    do_ptr += batch * stride_dob + head * stride_doh
    state_offset = (batch_head * num_chunks + chunk) * KEY_DIM * VALUE_DIM
    dtype = v_ptr.dtype.element_ty
    rows = chunk * CHUNK + tl.arange(0, CHUNK)
    in_range = rows[:, None] < seq_len
    key_cols = tl.arange(0, KEY_DIM)
    q = _feature_map_kernel(_load_rows(q_ptr, rows, key_cols, stride_qt, stride_qd, seq_len)).to(dtype)
    k = _feature_map_kernel(_load_rows(k_ptr, rows, key_cols, stride_kt, stride_kd, seq_len)).to(dtype)
    # Padding rows: as queries they meet dO = 0, as keys v = 0, and their own gradients are never stored.
    causal = tl.arange(0, CHUNK)[None, :] <= tl.arange(0, CHUNK)[:, None]
    scores = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=PRECISION), 0.0).to(dtype)

    grad_scores = tl.zeros([CHUNK, CHUNK], tl.float32)
    dq = tl.zeros([CHUNK, KEY_DIM], tl.float32)
    dk = tl.zeros([CHUNK, KEY_DIM], tl.float32)
    for block_start in tl.static_range(0, VALUE_DIM, BLOCK_V):
        value_cols = block_start + tl.arange(0, BLOCK_V)
        state_tile = key_cols[:, None] * VALUE_DIM + value_cols[None, :]
        state = tl.load(states_ptr + state_offset + state_tile)
        grad_state = tl.load(grad_states_ptr + state_offset + state_tile)
        v = _load_rows(v_ptr, rows, value_cols, stride_vt, stride_vd, seq_len)
        do = _load_rows(do_ptr, rows, value_cols, stride_dot, stride_dod, seq_len)
        grad_scores = tl.dot(do, tl.trans(v), grad_scores, input_precision=PRECISION)
        dq = tl.dot(do, tl.trans(state), dq, input_precision=PRECISION)
        dk = tl.dot(v, tl.trans(grad_state), dk, input_precision=PRECISION)
        dv = tl.dot(k, grad_state, input_precision=PRECISION)
        dv = tl.dot(tl.trans(scores), do, dv, input_precision=PRECISION)
        tl.store(dv_ptr + (batch_head * seq_len + rows[:, None]) * VALUE_DIM + value_cols[None, :], dv.to(dtype),
                 mask=in_range)
    grad_scores = tl.where(causal, grad_scores, 0.0).to(dtype)
    dq = tl.dot(grad_scores, k, dq, input_precision=PRECISION)
    dk = tl.dot(tl.trans(grad_scores), q, dk, input_precision=PRECISION)

    # phi' from the raw inputs, read again (from L2) rather than held in registers through the walk above.
    dq *= _feature_slope(_load_rows(q_ptr, rows, key_cols, stride_qt, stride_qd, seq_len))
    dk *= _feature_slope(_load_rows(k_ptr, rows, key_cols, stride_kt, stride_kd, seq_len))
    offsets = (batch_head * seq_len + rows[:, None]) * KEY_DIM + key_cols[None, :]
    tl.store(dq_ptr + offsets, dq.to(dtype), mask=in_range)
    tl.store(dk_ptr + offsets, dk.to(dtype), mask=in_range)


def _boundary_states(x: torch.Tensor, y: torch.Tensor, chunk_size: int, reverse: bool) -> torch.Tensor:
    """[batch*heads, chunks, x_dim, y_dim] in x's dtype: the sum of phi(X)^T Y before each chunk (after, if reverse)."""
    batch, heads, seq_len, x_dim = x.shape
    y_dim = y.shape[3]
    num_chunks = triton.cdiv(seq_len, chunk_size)
    states = torch.empty((batch * heads, num_chunks, x_dim, y_dim), dtype=x.dtype, device=x.device)
    config = _states_config(x.dtype, x_dim, y_dim)
    grid = ((x_dim // config["BLOCK_X"]) * (y_dim // config["BLOCK_Y"]), batch * heads)
    _states_kernel[grid](
        x, y, states, *x.stride(), *y.stride(), heads, seq_len, num_chunks,
        X_DIM=x_dim, Y_DIM=y_dim, REVERSE=reverse, CHUNK=chunk_size, PRECISION=_precision(x.dtype), **config,
    )
    return states


class LinearAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int) -> torch.Tensor:
        batch, heads, seq_len, key_dim = q.shape
        value_dim = v.shape[3]
        states = _boundary_states(k, v, chunk_size, reverse=False)
        o = torch.empty((batch, heads, seq_len, value_dim), dtype=q.dtype, device=q.device)
        config = _output_config(q.dtype, key_dim, value_dim)
        _output_kernel[(value_dim // config["BLOCK_V"], states.shape[1], batch * heads)](
            q, k, v, states, o, *q.stride(), *k.stride(), *v.stride(), heads, seq_len, states.shape[1],
            KEY_DIM=key_dim, VALUE_DIM=value_dim, CHUNK=chunk_size, PRECISION=_precision(q.dtype), **config,
        )
        ctx.save_for_backward(q, k, v, states)
        ctx.chunk_size = chunk_size
        return o

    @staticmethod
    def backward(ctx, grad_o: torch.Tensor):
        q, k, v, states = ctx.saved_tensors
        batch, heads, seq_len, key_dim = q.shape
        value_dim = v.shape[3]
        grad_states = _boundary_states(q, grad_o, ctx.chunk_size, reverse=True)
        grad_q = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        grad_k = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        grad_v = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        _gradient_kernel[(states.shape[1], batch * heads)](
            q, k, v, grad_o, states, grad_states, grad_q, grad_k, grad_v,
            *q.stride(), *k.stride(), *v.stride(), *grad_o.stride(), heads, seq_len, states.shape[1],
            KEY_DIM=key_dim, VALUE_DIM=value_dim, CHUNK=ctx.chunk_size, PRECISION=_precision(q.dtype),
            **_gradient_config(q.dtype, key_dim, value_dim),
        )
        return grad_q, grad_k, grad_v, None


def linear_attention_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """Causal linear attention by the chunked Triton kernels above, differentiable through LinearAttentionFunction."""
    check_arguments(q, k, v, chunk_size)
    return LinearAttentionFunction.apply(q, k, v, chunk_size)
