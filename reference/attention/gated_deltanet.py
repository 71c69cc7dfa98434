"""Gated DeltaNet, the chunked form in Triton (forward and backward), and the token-by-token recurrence.

For each (batch, head), with log-decay g_t <= 0 and writing strength beta_t:
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,        o_t = S_t^T q_t.
The chunked form cuts the sequence into chunks of C tokens. Inside a chunk, with S the state at its start and
b_i = g_1 + ... + g_i (cumulated from the chunk's first token):
    A      = strictly-lower(diag(beta) K K^T * exp(b_i - b_j))                    [C, C]
    T      = (I + A)^-1 diag(beta)                                                 (the UT transform)
    w      = T (exp(b) * K),   u = T V                                             pseudo-keys and pseudo-values
    v_new  = u - w S                                                               what each token really writes
    o      = exp(b) * (Q S) + (Q K^T * exp(b_i - b_j) [j <= i]) v_new
    S_next = exp(b_C) S + (exp(b_C - b) * K)^T v_new.
Every exponent is masked before it is taken and is then <= 0: g = -20 for thousands of tokens underflows to exact
zeros, never to inf or nan. (I + A) is inverted by forward substitution on its 16 x 16 diagonal blocks, all at once,
which are then joined two by two: the inverse of [[X, 0], [Y, Z]] is [[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]].

Forward, per (batch, head), for n tokens with key width dk and value width dv:
    _prepare_kernel, one program per chunk: reads k, v, g, beta; writes b (float32), w and u (n x dk, n x dv);
    _state_kernel, one program per block of value columns, walking the chunks in order with the state in registers:
        reads u, and w and k once per value block (the programs of one head run side by side, so the repeats mostly
        come from L2); writes v_new, each chunk's starting state (n/C of them) and the final state;
    _output_kernel, one program per (value block, chunk): reads q and k once per value block, b, v_new and the
        chunk's state; writes o.
The chunk states are the largest term: n dk dv / C numbers written and read once, 256 per token for C = 64 and
dk = dv = 128, against 128 per token for each of q, k, v, w, u, v_new and o.
Backward (all Triton): _prepare_kernel again (b, w, u); _backward_local_kernel (v_new from the saved states, and
dO's direct share of dv_new); _state_grad_kernel, walking the chunks in reverse with dS in registers, writes dv_new
in full and dS at each chunk's end (as many as the states); _grad_qk_kernel, one program per (key block, chunk),
gives dq and the shares of dk and dg that come through o and the states; _grad_wy_kernel, one program per chunk,
backpropagates through w, u and (I + A)^-1 and finishes dk, dv, dbeta and dg. Saved for backward: the inputs and
the chunk states, nothing per token.

Accumulation is float32 throughout. Half-precision operands are rounded to the input dtype just before the matrix
products, which is also the dtype in which w, u, v_new, the states, dv_new and dS pass between kernels; the
cumulated decays, the partial gradients and the inverse of (I + A) are float32 (the inverse is built with TF32
products for half-precision inputs, IEEE float32 ones for float32 inputs, and rounded like any other operand when
it multiplies K and V).
"""


import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128)
CHUNK_SIZES = (16, 32, 64)
# Side of the diagonal blocks of (I + A) inverted row by row; larger blocks are joined with matrix products. A kernel
# may only read globals that are compile-time constants.
_SOLVE_BLOCK = tl.constexpr(16)


def check_arguments(q, k, v, g, beta, initial_state=None, chunk_size=None) -> None:
    """The contract's argument checks, shared by the recurrent and the chunked forms."""
    named = (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta))
    if initial_state is not None:
        named += (("initial_state", initial_state),)
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"gated_deltanet expects {name} to be a torch.Tensor, got {type(tensor).__name__}")
    for name, tensor in named[:3]:
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"gated_deltanet supports dtypes {SUPPORTED_DTYPES}, got {name} of {tensor.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    for name, tensor in named[3:]:
        if tensor.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {tensor.dtype}")
    for name, tensor in named[:3]:
        if tensor.ndim != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, dim], got {tensor.ndim}-D")
    if k.shape[:3] != q.shape[:3] or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k and v must share batch, heads and seq, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k must have q's key width {q.shape[3]}, got {k.shape[3]}")
    if 0 in q.shape or 0 in v.shape:
        raise ValueError(f"every dimension must be at least 1, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    if q.shape[3] not in HEAD_DIMS or v.shape[3] not in HEAD_DIMS:
        raise ValueError(f"key and value widths must be in {HEAD_DIMS}, got {q.shape[3]} and {v.shape[3]}")
    for name, tensor in named[3:5]:
        if tensor.shape != q.shape[:3]:
            raise ValueError(f"{name} must be [batch, heads, seq] = {tuple(q.shape[:3])}, got {tuple(tensor.shape)}")
    state_shape = (*q.shape[:2], q.shape[3], v.shape[3])
    if initial_state is not None and initial_state.shape != state_shape:
        raise ValueError(f"initial_state must be [batch, heads, key width, value width] = {state_shape}, got "
                         f"{tuple(initial_state.shape)}")
    devices = {tensor.device for _, tensor in named}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or chunk_size not in CHUNK_SIZES):
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")


# Block sizes and warps. BLOCK_V, BLOCK_K: value and key columns per program of the kernels parallel over chunks
# that split them; STEP_V, STEP_K: the columns the backward kernels take per step of their loops; SCAN_V: value
# columns per program of the walks over the chunks (_state_kernel, _state_grad_kernel), which run one program per
# (batch, head, value block), so that narrow blocks give more programs to hide each step's latency. SOLVE_WARPS:
# the kernels that invert (I + A) (_prepare_kernel, _grad_wy_kernel), whose time is a chain of dependent steps that
# synchronise every warp of the program: four warps in half precision took them from 2.86 and 2.41 ms to 1.32 and
# 1.21 ms (forward and backward, T = 16384, widths 64, H200), with the same errors. The other kernels parallel over
# chunks stay at eight: at four, Triton 3.6 gave dk errors ten times larger in both half precisions. At eight warps
# no kernel spilled more than a few registers at widths 64 and 128 in bfloat16 on sm_90 (the solving kernels' spills
# at four were not measured); float32 tiles take twice the shared memory, so there the walks keep two stages of
# their loads, not three. Under the interpreter the blocks are small so that short tests cross them.
def _config(dtype: torch.dtype, key_dim: int, value_dim: int) -> dict:
    if triton.knobs.runtime.interpret:
        return dict(BLOCK_K=min(key_dim, 16), BLOCK_V=min(value_dim, 16), STEP_K=min(key_dim, 16),
                    STEP_V=min(value_dim, 16), SCAN_V=min(value_dim, 16), WARPS=1, SCAN_WARPS=1, SOLVE_WARPS=1,
                    SCAN_STAGES=1)
    wide = max(key_dim, value_dim) >= 64 or dtype == torch.float32
    warps, scan_warps = 8 if wide else 4, 8 if key_dim > 64 or dtype == torch.float32 else 4
    solve_warps = 8 if dtype == torch.float32 else 4
    if dtype != torch.float32 and min(key_dim, value_dim) < 64:
        # Triton 3.6 on an H200 miscompiled these kernels' half-precision tensor-core products at narrow widths
        # (wrong values or illegal addresses at K > V with V <= 32, and at K = 16, V = 32, on four or eight warps;
        # float32 was right). Two warps take another instruction path and gave the right values at every pair of
        # widths from 16 to 128 and chunks of 16, 32 and 64, against the float64 recurrence at T = 513.
        warps = scan_warps = solve_warps = 2
    return dict(BLOCK_K=min(key_dim, 64), BLOCK_V=min(value_dim, 64), STEP_K=min(key_dim, 32),
                STEP_V=min(value_dim, 32), SCAN_V=min(value_dim, 32), WARPS=warps, SCAN_WARPS=scan_warps,
                SOLVE_WARPS=solve_warps, SCAN_STAGES=2 if dtype == torch.float32 else 3)


@triton.jit
def _load_tile(ptr, rows, cols, row_stride, col_stride, n_rows):
    """Tile [len(rows), len(cols)] of a strided input; rows at or past n_rows (the last chunk's padding) read 0."""
    return tl.load(ptr + rows[:, None] * row_stride + cols[None, :] * col_stride, mask=rows[:, None] < n_rows,
                   other=0.0)


@triton.jit
def _store_tile(ptr, tile, rows, cols, row_stride, col_stride, n_rows):
    tl.store(ptr + rows[:, None] * row_stride + cols[None, :] * col_stride, tile.to(ptr.dtype.element_ty),
             mask=rows[:, None] < n_rows)


@triton.jit
def _decay(b, INCLUSIVE: tl.constexpr):
    """[C, C]: exp(b_i - b_j) where j <= i (j < i unless INCLUSIVE), else 0. b never grows within a chunk (the
    padding repeats the last value), so the kept exponents are <= 0; the others become -inf, i.e. exp = 0."""
    idx = tl.arange(0, b.shape[0])
    if INCLUSIVE:
        keep = idx[:, None] >= idx[None, :]
    else:
        keep = idx[:, None] > idx[None, :]
    return tl.exp(tl.where(keep, b[:, None] - b[None, :], -float("inf")))


@triton.jit
def _pair_sums(pairs):
    """[C]: for every t, the sum of pairs[i, j] over i >= t > j. pairs[i, j] is the derivative by b_i - b_j, and g_t
    is a term of b_i - b_j exactly when j < t <= i. Summed as such, never as sums over i minus sums over j, which
    would leave the rounding error of large cancelling terms where the true gradient is tiny (strong decay)."""
    idx = tl.arange(0, pairs.shape[0])
    below = tl.cumsum(pairs, axis=0, reverse=True)  # below[t, j] = sum over i >= t of pairs[i, j]
    return tl.sum(tl.where(idx[None, :] < idx[:, None], below, 0.0), axis=1)


@triton.jit
def _quarters(x, HALF: tl.constexpr):
    """The four HALF x HALF blocks of a square tile: top-left, top-right, bottom-left, bottom-right."""
    x = tl.permute(tl.reshape(x, [2, HALF, 2, HALF]), [1, 3, 0, 2])  # [row, col, row half, col half]
    left, right = tl.split(x)
    top_left, bottom_left = tl.split(left)
    top_right, bottom_right = tl.split(right)
    return top_left, top_right, bottom_left, bottom_right


@triton.jit
def _join_lower(top_left, bottom_left, bottom_right, HALF: tl.constexpr):
    """The square tile [[top_left, 0], [bottom_left, bottom_right]]."""
    top = tl.join(top_left, tl.zeros_like(top_left))
    bottom = tl.join(bottom_left, bottom_right)
    x = tl.join(top, bottom)  # [row, col, col half, row half]
    return tl.reshape(tl.permute(x, [3, 0, 2, 1]), [2 * HALF, 2 * HALF])


@triton.jit
def _substitute(a):
    """(I + a)^-1 of each strictly lower-triangular float32 tile of a stack [16, 16, N], by forward substitution:
    row r of the inverse is e_r - sum_{j < r} a[r, j] * (row j of the inverse), and rows j < r are final when row r
    is built. The N tiles take their 15 steps together: the steps are a chain of dependent reductions, so one
    program's time is set by their number, not by the tiles each step covers."""
    rows = tl.arange(0, _SOLVE_BLOCK)[:, None, None]
    cols = tl.arange(0, _SOLVE_BLOCK)[None, :, None]
    inverse = tl.where(rows == cols, 1.0, 0.0) + tl.zeros_like(a)
    for r in range(1, _SOLVE_BLOCK):
        a_row = tl.sum(tl.where(rows == r, a, 0.0), axis=0)  # [16 (j), N]: a[r, j]
        correction = tl.sum(a_row[:, None, :] * inverse, axis=0)  # [16 (column), N]
        inverse -= tl.where(rows == r, correction[None, :, :], 0.0)
    return inverse


@triton.jit
def _merge(inverse_top, a_cross, inverse_bottom, HALF: tl.constexpr, PRECISION: tl.constexpr):
    """The inverse of [[I + X, 0], [Y, I + Z]] from (I + X)^-1, Y and (I + Z)^-1: its lower-left block is
    -(I + Z)^-1 Y (I + X)^-1."""
    cross = tl.dot(a_cross, inverse_top, input_precision=PRECISION)
    inverse_cross = -tl.dot(inverse_bottom, cross, input_precision=PRECISION)
    return _join_lower(inverse_top, inverse_cross, inverse_bottom, HALF)


@triton.jit
def _unit_lower_inverse(a, SIZE: tl.constexpr, PRECISION: tl.constexpr):
    """(I + a)^-1 for a strictly lower-triangular float32 tile [SIZE, SIZE], SIZE in 16, 32, 64: its diagonal
    16 x 16 blocks by one joint substitution, then joined two by two."""
    if SIZE == _SOLVE_BLOCK:
        inverse = tl.reshape(_substitute(tl.expand_dims(a, 2)), [SIZE, SIZE])
    elif SIZE == 2 * _SOLVE_BLOCK:
        a_top, _, a_cross, a_bottom = _quarters(a, _SOLVE_BLOCK)
        inverse_top, inverse_bottom = tl.split(_substitute(tl.join(a_top, a_bottom)))
        inverse = _merge(inverse_top, a_cross, inverse_bottom, _SOLVE_BLOCK, PRECISION)
    else:
        HALF: tl.constexpr = SIZE // 2
        a_top, _, a_cross, a_bottom = _quarters(a, HALF)
        a11, _, a21, a22 = _quarters(a_top, _SOLVE_BLOCK)
        a33, _, a43, a44 = _quarters(a_bottom, _SOLVE_BLOCK)
        # [16, 16, 2, 2] indexed [.., block within its half, top or bottom half]: tl.join stacks on a new last axis
        inverses = tl.reshape(_substitute(tl.reshape(tl.join(tl.join(a11, a22), tl.join(a33, a44)),
                                                     [_SOLVE_BLOCK, _SOLVE_BLOCK, 4])),
                              [_SOLVE_BLOCK, _SOLVE_BLOCK, 2, 2])
        top_blocks, bottom_blocks = tl.split(inverses)
        inverse11, inverse22 = tl.split(top_blocks)
        inverse33, inverse44 = tl.split(bottom_blocks)
        inverse_top = _merge(inverse11, a21, inverse22, _SOLVE_BLOCK, PRECISION)
        inverse_bottom = _merge(inverse33, a43, inverse44, _SOLVE_BLOCK, PRECISION)
        inverse = _merge(inverse_top, a_cross, inverse_bottom, HALF, PRECISION)
    return inverse


@triton.jit
def _wy_inverse(kk, b, beta, SOLVE_PRECISION: tl.constexpr):
    """(the decay strictly below the diagonal, (I + A)^-1) of one chunk, from kk = K K^T, where
    A[i, j] = beta_i (k_i . k_j) exp(b_i - b_j) for j < i and 0 elsewhere."""
    decay = _decay(b, False)
    return decay, _unit_lower_inverse(kk * decay * beta[:, None], b.shape[0], SOLVE_PRECISION)


@triton.jit
def _prepare_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, b_ptr, w_ptr, u_ptr,
                    stride_kb, stride_kh, stride_kt, stride_kd,
                    stride_vb, stride_vh, stride_vt, stride_vd,
                    stride_gb, stride_gh, stride_gt,
                    stride_betab, stride_betah, stride_betat,
                    num_heads, seq_len,
                    KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, CHUNK: tl.constexpr,
                    PRECISION: tl.constexpr, SOLVE_PRECISION: tl.constexpr):
    """b (the chunk's cumulated g), w = T (exp(b) * K) and u = T V for one (chunk, batch*head).

    b, w and u are contiguous [batch*heads, padded seq, .]: the padding (g = beta = k = v = 0) gives w = u = 0 and
    b = the chunk's last value, so later kernels read them without masks."""
    chunk = tl.program_id(0)
    batch_head = tl.program_id(1).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    padded_len = tl.num_programs(0) * CHUNK
    rows = chunk * CHUNK + tl.arange(0, CHUNK)
    key_cols = tl.arange(0, KEY_DIM)
    value_cols = tl.arange(0, VALUE_DIM)
    in_seq = rows < seq_len
    g = tl.load(g_ptr + batch * stride_gb + head * stride_gh + rows * stride_gt, mask=in_seq, other=0.0)
    beta = tl.load(beta_ptr + batch * stride_betab + head * stride_betah + rows * stride_betat, mask=in_seq,
                   other=0.0)
    b = tl.cumsum(g, axis=0)
    tl.store(b_ptr + batch_head * padded_len + rows, b)
    k = _load_tile(k_ptr + batch * stride_kb + head * stride_kh, rows, key_cols, stride_kt, stride_kd, seq_len)
    v = _load_tile(v_ptr + batch * stride_vb + head * stride_vh, rows, value_cols, stride_vt, stride_vd, seq_len)
    _, inverse = _wy_inverse(tl.dot(k, tl.trans(k), input_precision=PRECISION), b, beta, SOLVE_PRECISION)
    inverse = inverse.to(k.dtype)
    w = tl.dot(inverse, (k * (beta * tl.exp(b))[:, None]).to(k.dtype), input_precision=PRECISION)
    u = tl.dot(inverse, (v * beta[:, None]).to(v.dtype), input_precision=PRECISION)
    tl.store(w_ptr + batch_head * padded_len * KEY_DIM + rows[:, None] * KEY_DIM + key_cols[None, :],
             w.to(w_ptr.dtype.element_ty))
    tl.store(u_ptr + batch_head * padded_len * VALUE_DIM + rows[:, None] * VALUE_DIM + value_cols[None, :],
             u.to(u_ptr.dtype.element_ty))


@triton.jit
def _state_kernel(k_ptr, w_ptr, u_ptr, b_ptr, initial_ptr, states_ptr, v_new_ptr, final_ptr,
                  stride_kb, stride_kh, stride_kt, stride_kd,
                  stride_sb, stride_sh, stride_sk, stride_sv,
                  num_heads, seq_len, num_chunks,
                  KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_V: tl.constexpr,
                  HAS_INITIAL: tl.constexpr, PRECISION: tl.constexpr):
    """Walks the chunks of one (value block, batch*head) in order: stores each chunk's starting state, then
    v_new = u - w S and S <- exp(b_last) S + (exp(b_last - b) * K)^T v_new; last the final state (float32)."""
    value_cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    batch_head = tl.program_id(1).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    padded_len = num_chunks * CHUNK
    key_cols = tl.arange(0, KEY_DIM)
    state_offsets = key_cols[:, None] * VALUE_DIM + value_cols[None, :]
    if HAS_INITIAL:
        state = _load_tile(initial_ptr + batch * stride_sb + head * stride_sh, key_cols, value_cols, stride_sk,
                           stride_sv, KEY_DIM)
    else:
        state = tl.zeros([KEY_DIM, BLOCK_V], tl.float32)
    k_ptr += batch * stride_kb + head * stride_kh
    w_ptr += batch_head * padded_len * KEY_DIM
    u_ptr += batch_head * padded_len * VALUE_DIM
    v_new_ptr += batch_head * padded_len * VALUE_DIM
    b_ptr += batch_head * padded_len
    states_ptr += batch_head * num_chunks * KEY_DIM * VALUE_DIM
    for chunk in range(num_chunks):
        rows = chunk * CHUNK + tl.arange(0, CHUNK)
        tl.store(states_ptr + chunk * KEY_DIM * VALUE_DIM + state_offsets, state.to(states_ptr.dtype.element_ty))
        w = tl.load(w_ptr + rows[:, None] * KEY_DIM + key_cols[None, :])
        u = tl.load(u_ptr + rows[:, None] * VALUE_DIM + value_cols[None, :])
        v_new = (u - tl.dot(w, state.to(w.dtype), input_precision=PRECISION)).to(w.dtype)
        tl.store(v_new_ptr + rows[:, None] * VALUE_DIM + value_cols[None, :], v_new)
        b = tl.load(b_ptr + rows)
        b_last = tl.load(b_ptr + chunk * CHUNK + CHUNK - 1)
        k = _load_tile(k_ptr, rows, key_cols, stride_kt, stride_kd, seq_len)
        k_decayed = (k * tl.exp(b_last - b)[:, None]).to(k.dtype)
        state = tl.dot(tl.trans(k_decayed), v_new, state * tl.exp(b_last), input_precision=PRECISION)
    tl.store(final_ptr + batch_head * KEY_DIM * VALUE_DIM + state_offsets, state)


@triton.jit
def _output_kernel(q_ptr, k_ptr, b_ptr, states_ptr, v_new_ptr, o_ptr,
                   stride_qb, stride_qh, stride_qt, stride_qd,
                   stride_kb, stride_kh, stride_kt, stride_kd,
                   num_heads, seq_len,
                   KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_V: tl.constexpr,
                   PRECISION: tl.constexpr):
    """o = exp(b) * (Q S) + (Q K^T * decay) v_new for one (value block, chunk, batch*head); o is contiguous."""
    value_cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    chunk = tl.program_id(1)
    batch_head = tl.program_id(2).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    padded_len = tl.num_programs(1) * CHUNK
    rows = chunk * CHUNK + tl.arange(0, CHUNK)
    key_cols = tl.arange(0, KEY_DIM)
    q = _load_tile(q_ptr + batch * stride_qb + head * stride_qh, rows, key_cols, stride_qt, stride_qd, seq_len)
    k = _load_tile(k_ptr + batch * stride_kb + head * stride_kh, rows, key_cols, stride_kt, stride_kd, seq_len)
    b = tl.load(b_ptr + batch_head * padded_len + rows)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * _decay(b, True)
    state = tl.load(states_ptr + (batch_head * tl.num_programs(1) + chunk) * KEY_DIM * VALUE_DIM
                    + key_cols[:, None] * VALUE_DIM + value_cols[None, :])
    v_new = tl.load(v_new_ptr + batch_head * padded_len * VALUE_DIM + rows[:, None] * VALUE_DIM + value_cols[None, :])
    o = tl.dot(q, state, input_precision=PRECISION) * tl.exp(b)[:, None]
    o = tl.dot(scores.to(v_new.dtype), v_new, o, input_precision=PRECISION)
    _store_tile(o_ptr + batch_head * seq_len * VALUE_DIM, o, rows, value_cols, VALUE_DIM, 1, seq_len)


@triton.jit
def _backward_local_kernel(q_ptr, k_ptr, do_ptr, b_ptr, w_ptr, u_ptr, states_ptr, v_new_ptr, dv_local_ptr,
                           stride_qb, stride_qh, stride_qt, stride_qd,
                           stride_kb, stride_kh, stride_kt, stride_kd,
                           stride_dob, stride_doh, stride_dot, stride_dod,
                           num_heads, seq_len,
                           KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, CHUNK: tl.constexpr,
                           BLOCK_V: tl.constexpr, PRECISION: tl.constexpr):
    """v_new = u - w S again, and dO's direct share of dv_new, (Q K^T * decay)^T dO (float32), for one
    (value block, chunk, batch*head)."""
    value_cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    chunk = tl.program_id(1)
    batch_head = tl.program_id(2).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    padded_len = tl.num_programs(1) * CHUNK
    rows = chunk * CHUNK + tl.arange(0, CHUNK)
    key_cols = tl.arange(0, KEY_DIM)
    value_offsets = batch_head * padded_len * VALUE_DIM + rows[:, None] * VALUE_DIM + value_cols[None, :]
    w = tl.load(w_ptr + batch_head * padded_len * KEY_DIM + rows[:, None] * KEY_DIM + key_cols[None, :])
    state = tl.load(states_ptr + (batch_head * tl.num_programs(1) + chunk) * KEY_DIM * VALUE_DIM
                    + key_cols[:, None] * VALUE_DIM + value_cols[None, :])
    v_new = tl.load(u_ptr + value_offsets) - tl.dot(w, state, input_precision=PRECISION)
    tl.store(v_new_ptr + value_offsets, v_new.to(v_new_ptr.dtype.element_ty))

    q = _load_tile(q_ptr + batch * stride_qb + head * stride_qh, rows, key_cols, stride_qt, stride_qd, seq_len)
    k = _load_tile(k_ptr + batch * stride_kb + head * stride_kh, rows, key_cols, stride_kt, stride_kd, seq_len)
    do = _load_tile(do_ptr + batch * stride_dob + head * stride_doh, rows, value_cols, stride_dot, stride_dod,
                    seq_len)
    b = tl.load(b_ptr + batch_head * padded_len + rows)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * _decay(b, True)
    dv_local = tl.dot(tl.trans(scores.to(do.dtype)), do, input_precision=PRECISION)
    tl.store(dv_local_ptr + value_offsets, dv_local)


@triton.jit
def _state_grad_kernel(q_ptr, k_ptr, do_ptr, b_ptr, w_ptr, dv_local_ptr, grad_final_ptr, grad_states_ptr,
                       dv_new_ptr, grad_initial_ptr,
                       stride_qb, stride_qh, stride_qt, stride_qd,
                       stride_kb, stride_kh, stride_kt, stride_kd,
                       stride_dob, stride_doh, stride_dot, stride_dod,
                       stride_sb, stride_sh, stride_sk, stride_sv,
                       num_heads, seq_len, num_chunks,
                       KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, CHUNK: tl.constexpr,
                       BLOCK_V: tl.constexpr, PRECISION: tl.constexpr):
    """Walks the chunks of one (value block, batch*head) in reverse with dS, the gradient of the state at the end
    of the chunk: stores it, then dv_new = dv_local + (exp(b_last - b) * K) dS and
    dS <- exp(b_last) dS + (exp(b) * Q)^T dO - w^T dv_new; last dS = the initial state's gradient (float32)."""
    value_cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    batch_head = tl.program_id(1).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    padded_len = num_chunks * CHUNK
    key_cols = tl.arange(0, KEY_DIM)
    state_offsets = key_cols[:, None] * VALUE_DIM + value_cols[None, :]
    grad_state = _load_tile(grad_final_ptr + batch * stride_sb + head * stride_sh, key_cols, value_cols, stride_sk,
                            stride_sv, KEY_DIM)
    q_ptr += batch * stride_qb + head * stride_qh
    k_ptr += batch * stride_kb + head * stride_kh
    do_ptr += batch * stride_dob + head * stride_doh
    w_ptr += batch_head * padded_len * KEY_DIM
    dv_local_ptr += batch_head * padded_len * VALUE_DIM
    dv_new_ptr += batch_head * padded_len * VALUE_DIM
    b_ptr += batch_head * padded_len
    grad_states_ptr += batch_head * num_chunks * KEY_DIM * VALUE_DIM
    for step in range(num_chunks):
        chunk = num_chunks - 1 - step
        rows = chunk * CHUNK + tl.arange(0, CHUNK)
        tl.store(grad_states_ptr + chunk * KEY_DIM * VALUE_DIM + state_offsets,
                 grad_state.to(grad_states_ptr.dtype.element_ty))
        b = tl.load(b_ptr + rows)
        b_last = tl.load(b_ptr + chunk * CHUNK + CHUNK - 1)
        k = _load_tile(k_ptr, rows, key_cols, stride_kt, stride_kd, seq_len)
        k_decayed = (k * tl.exp(b_last - b)[:, None]).to(k.dtype)
        dv_new = tl.dot(k_decayed, grad_state.to(k.dtype), tl.load(dv_local_ptr + rows[:, None] * VALUE_DIM
                                                                    + value_cols[None, :]),
                        input_precision=PRECISION).to(k.dtype)
        tl.store(dv_new_ptr + rows[:, None] * VALUE_DIM + value_cols[None, :], dv_new)
        q = _load_tile(q_ptr, rows, key_cols, stride_qt, stride_qd, seq_len)
        do = _load_tile(do_ptr, rows, value_cols, stride_dot, stride_dod, seq_len)
        w = tl.load(w_ptr + rows[:, None] * KEY_DIM + key_cols[None, :])
        q_decayed = (q * tl.exp(b)[:, None]).to(q.dtype)
        grad_state = tl.dot(tl.trans(q_decayed), do.to(q.dtype), grad_state * tl.exp(b_last),
                            input_precision=PRECISION)
        grad_state -= tl.dot(tl.trans(w), dv_new, input_precision=PRECISION)
    tl.store(grad_initial_ptr + batch_head * KEY_DIM * VALUE_DIM + state_offsets, grad_state)


@triton.jit
def _grad_qk_kernel(q_ptr, k_ptr, do_ptr, b_ptr, states_ptr, grad_states_ptr, v_new_ptr, dv_new_ptr,
                    dq_ptr, dk_part_ptr, dw_ptr, dg_part_ptr,
                    stride_qb, stride_qh, stride_qt, stride_qd,
                    stride_kb, stride_kh, stride_kt, stride_kd,
                    stride_dob, stride_doh, stride_dot, stride_dod,
                    num_heads, seq_len,
                    KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, CHUNK: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr):
    """For one (key block, chunk, batch*head), with S and dS' the states and their gradients at the chunk's start
    and end, G = dO v_new^T * decay, and lam = exp(b_last - b):
        dq  = exp(b) * (dO S^T) + G K                                   (final)
        dk  = G^T Q + lam * (v_new dS'^T)                               (o's and the next state's share, float32)
        dw  = -dv_new S^T
        dg  = revcumsum(exp(b) * rowsum(Q * dO S^T)) + exp(b_last) <S, dS'> + pair sums of Q K^T * G, and of
              r = lam * rowsum(K * v_new dS'^T) on the last row: this key block's share of dg, float32.
    revcumsum(x)_t = sum over i >= t of x_i: g_t is a term of every b_i with i >= t. The products over the value
    width are accumulated block by block."""
    key_cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    chunk = tl.program_id(1)
    batch_head = tl.program_id(2).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    num_chunks = tl.num_programs(1)
    padded_len = num_chunks * CHUNK
    idx = tl.arange(0, CHUNK)
    rows = chunk * CHUNK + idx
    q = _load_tile(q_ptr + batch * stride_qb + head * stride_qh, rows, key_cols, stride_qt, stride_qd, seq_len)
    k = _load_tile(k_ptr + batch * stride_kb + head * stride_kh, rows, key_cols, stride_kt, stride_kd, seq_len)
    do_ptr += batch * stride_dob + head * stride_doh
    states_ptr += (batch_head * num_chunks + chunk) * KEY_DIM * VALUE_DIM
    grad_states_ptr += (batch_head * num_chunks + chunk) * KEY_DIM * VALUE_DIM
    value_rows_ptr = batch_head * padded_len * VALUE_DIM + rows[:, None] * VALUE_DIM

    dq = tl.zeros([CHUNK, BLOCK_K], tl.float32)
    dk = tl.zeros([CHUNK, BLOCK_K], tl.float32)
    dw = tl.zeros([CHUNK, BLOCK_K], tl.float32)
    grad_scores = tl.zeros([CHUNK, CHUNK], tl.float32)
    state_products = tl.zeros([BLOCK_K], tl.float32)
    for value_start in range(0, VALUE_DIM, BLOCK_V):
        value_cols = value_start + tl.arange(0, BLOCK_V)
        state_offsets = key_cols[:, None] * VALUE_DIM + value_cols[None, :]
        state = tl.load(states_ptr + state_offsets)
        grad_state = tl.load(grad_states_ptr + state_offsets)
        do = _load_tile(do_ptr, rows, value_cols, stride_dot, stride_dod, seq_len).to(q.dtype)
        v_new = tl.load(v_new_ptr + value_rows_ptr + value_cols[None, :])
        dv_new = tl.load(dv_new_ptr + value_rows_ptr + value_cols[None, :])
        dq = tl.dot(do, tl.trans(state), dq, input_precision=PRECISION)
        dk = tl.dot(v_new, tl.trans(grad_state), dk, input_precision=PRECISION)
        dw = tl.dot(dv_new, tl.trans(state), dw, input_precision=PRECISION)
        grad_scores = tl.dot(do, tl.trans(v_new), grad_scores, input_precision=PRECISION)
        state_products += tl.sum(state.to(tl.float32) * grad_state.to(tl.float32), axis=1)

    b = tl.load(b_ptr + batch_head * padded_len + rows)
    b_last = tl.load(b_ptr + batch_head * padded_len + chunk * CHUNK + CHUNK - 1)
    gamma = tl.exp(b)
    lam = tl.exp(b_last - b)
    grad_scores *= _decay(b, True)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    # The pairs (i, j) through their decay exp(b_i - b_j): those of o, and (last row, j) of the next state.
    r = lam * tl.sum(k.to(tl.float32) * dk, axis=1)
    pairs = scores * grad_scores + tl.where(idx[:, None] == CHUNK - 1, r[None, :], 0.0)
    dg = tl.cumsum(gamma * tl.sum(q.to(tl.float32) * dq, axis=1), axis=0, reverse=True) + _pair_sums(pairs)
    dg += tl.exp(b_last) * tl.sum(state_products, axis=0)
    tl.store(dg_part_ptr + (tl.program_id(0) * tl.num_programs(2) + batch_head) * padded_len + rows, dg)

    grad_scores = grad_scores.to(q.dtype)
    dq = tl.dot(grad_scores, k, dq * gamma[:, None], input_precision=PRECISION)
    dk = tl.dot(tl.trans(grad_scores), q, dk * lam[:, None], input_precision=PRECISION)
    _store_tile(dq_ptr + batch_head * seq_len * KEY_DIM, dq, rows, key_cols, KEY_DIM, 1, seq_len)
    key_offsets = batch_head * padded_len * KEY_DIM + rows[:, None] * KEY_DIM + key_cols[None, :]
    tl.store(dk_part_ptr + key_offsets, dk)
    tl.store(dw_ptr + key_offsets, (-dw).to(dw_ptr.dtype.element_ty))


@triton.jit
def _grad_wy_kernel(k_ptr, v_ptr, beta_ptr, b_ptr, dv_new_ptr, dw_ptr, dk_part_ptr, dg_part_ptr,
                    dk_ptr, dv_ptr, dbeta_ptr, dg_ptr,
                    stride_kb, stride_kh, stride_kt, stride_kd,
                    stride_vb, stride_vh, stride_vt, stride_vd,
                    stride_betab, stride_betah, stride_betat,
                    num_heads, seq_len,
                    KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_V: tl.constexpr, KEY_BLOCKS: tl.constexpr, PRECISION: tl.constexpr,
                    SOLVE_PRECISION: tl.constexpr):
    """Through u = T V, w = T (exp(b) K) and T = (I + A)^-1 diag(beta), for one (chunk, batch*head). With N the
    inverse of (I + A): dXu = N^T dv_new, dXw = N^T dw, dA = -strictly-lower(dXu u^T + dXw w^T), E = dA * decay:
        dv = beta * dXu
        dk = (the part from _grad_qk_kernel) + beta exp(b) * dXw + (beta E + (beta E)^T) K
        dbeta = rowsum(dXu * V) + exp(b) * rowsum(dXw * K) + rowsum(E * K K^T)
        dg = (the KEY_BLOCKS parts from _grad_qk_kernel) + revcumsum(beta exp(b) * rowsum(dXw * K))
             + pair sums of dA * A.
    The key columns are visited in blocks three times (K K^T; then dXw and w for dA; then dk once dA is known), so
    that no [C, key width] float32 tile has to stay in registers."""
    chunk = tl.program_id(0)
    batch_head = tl.program_id(1).to(tl.int64)
    batch, head = batch_head // num_heads, batch_head % num_heads
    num_chunks = tl.num_programs(0)
    padded_len = num_chunks * CHUNK
    rows = chunk * CHUNK + tl.arange(0, CHUNK)
    in_seq = rows < seq_len
    beta = tl.load(beta_ptr + batch * stride_betab + head * stride_betah + rows * stride_betat, mask=in_seq,
                   other=0.0)
    b = tl.load(b_ptr + batch_head * padded_len + rows)
    gamma = tl.exp(b)
    k_ptr += batch * stride_kb + head * stride_kh
    key_rows_ptr = batch_head * padded_len * KEY_DIM + rows[:, None] * KEY_DIM
    kk = tl.zeros([CHUNK, CHUNK], tl.float32)
    for key_start in range(0, KEY_DIM, BLOCK_K):
        k = _load_tile(k_ptr, rows, key_start + tl.arange(0, BLOCK_K), stride_kt, stride_kd, seq_len)
        kk = tl.dot(k, tl.trans(k), kk, input_precision=PRECISION)
    decay, inverse = _wy_inverse(kk, b, beta, SOLVE_PRECISION)
    inverse = inverse.to(k_ptr.dtype.element_ty)

    grad_a = tl.zeros([CHUNK, CHUNK], tl.float32)
    dbeta = tl.zeros([CHUNK], tl.float32)
    v_ptr += batch * stride_vb + head * stride_vh
    dv_ptr += batch_head * seq_len * VALUE_DIM
    for value_start in range(0, VALUE_DIM, BLOCK_V):
        value_cols = value_start + tl.arange(0, BLOCK_V)
        v = _load_tile(v_ptr, rows, value_cols, stride_vt, stride_vd, seq_len)
        dv_new = tl.load(dv_new_ptr + batch_head * padded_len * VALUE_DIM + rows[:, None] * VALUE_DIM
                         + value_cols[None, :])
        dx = tl.dot(tl.trans(inverse), dv_new, input_precision=PRECISION)
        _store_tile(dv_ptr, dx * beta[:, None], rows, value_cols, VALUE_DIM, 1, seq_len)
        dbeta += tl.sum(dx * v.to(tl.float32), axis=1)
        u = tl.dot(inverse, (v * beta[:, None]).to(v.dtype), input_precision=PRECISION)
        grad_a = tl.dot(dx.to(v.dtype), tl.trans(u.to(v.dtype)), grad_a, input_precision=PRECISION)

    k_scale = beta * gamma
    k_products = tl.zeros([CHUNK], tl.float32)
    for key_start in range(0, KEY_DIM, BLOCK_K):
        key_cols = key_start + tl.arange(0, BLOCK_K)
        k = _load_tile(k_ptr, rows, key_cols, stride_kt, stride_kd, seq_len)
        dxw = tl.dot(tl.trans(inverse), tl.load(dw_ptr + key_rows_ptr + key_cols[None, :]), input_precision=PRECISION)
        w = tl.dot(inverse, (k * k_scale[:, None]).to(k.dtype), input_precision=PRECISION)
        grad_a = tl.dot(dxw.to(k.dtype), tl.trans(w.to(k.dtype)), grad_a, input_precision=PRECISION)
        k_products += tl.sum(dxw * k.to(tl.float32), axis=1)
    dbeta += gamma * k_products

    e = -grad_a * decay
    e_kk = e * kk
    dbeta += tl.sum(e_kk, axis=1)
    dg = tl.cumsum(k_scale * k_products, axis=0, reverse=True) + _pair_sums(e_kk * beta[:, None])
    for key_block in range(KEY_BLOCKS):
        dg += tl.load(dg_part_ptr + (key_block * tl.num_programs(1) + batch_head) * padded_len + rows)
    tl.store(dg_ptr + batch_head * seq_len + rows, dg, mask=in_seq)
    tl.store(dbeta_ptr + batch_head * seq_len + rows, dbeta, mask=in_seq)

    beta_e = e * beta[:, None]
    beta_e = (beta_e + tl.trans(beta_e)).to(inverse.dtype)
    dk_ptr += batch_head * seq_len * KEY_DIM
    for key_start in range(0, KEY_DIM, BLOCK_K):
        key_cols = key_start + tl.arange(0, BLOCK_K)
        k = _load_tile(k_ptr, rows, key_cols, stride_kt, stride_kd, seq_len)
        dxw = tl.dot(tl.trans(inverse), tl.load(dw_ptr + key_rows_ptr + key_cols[None, :]), input_precision=PRECISION)
        dk = tl.load(dk_part_ptr + key_rows_ptr + key_cols[None, :]) + dxw * k_scale[:, None]
        dk = tl.dot(beta_e, k, dk, input_precision=PRECISION)
        _store_tile(dk_ptr, dk, rows, key_cols, KEY_DIM, 1, seq_len)


def _precisions(dtype: torch.dtype) -> tuple[str, str]:
    """(products of input-dtype operands, products inside the inverse): float32 inputs multiply at full precision;
    the float32 inverse of a half-precision problem is built with TF32 products."""
    return ("ieee", "ieee") if dtype == torch.float32 else ("tf32", "tf32")


def _strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    return tuple(s for t in tensors for s in t.stride())


def _prepare(k, v, g, beta, chunk_size: int, config: dict):
    """(b, w, u) of every chunk: contiguous [batch*heads, padded seq(, width)]."""
    batch, heads, seq_len, key_dim = k.shape
    value_dim = v.shape[-1]
    num_chunks = triton.cdiv(seq_len, chunk_size)
    padded_len = num_chunks * chunk_size
    b = torch.empty(batch * heads, padded_len, dtype=torch.float32, device=k.device)
    w = torch.empty(batch * heads, padded_len, key_dim, dtype=k.dtype, device=k.device)
    u = torch.empty(batch * heads, padded_len, value_dim, dtype=k.dtype, device=k.device)
    precision, solve_precision = _precisions(k.dtype)
    _prepare_kernel[(num_chunks, batch * heads)](
        k, v, g, beta, b, w, u, *_strides(k, v, g, beta), heads, seq_len,
        KEY_DIM=key_dim, VALUE_DIM=value_dim, CHUNK=chunk_size, PRECISION=precision,
        SOLVE_PRECISION=solve_precision, num_warps=config["SOLVE_WARPS"],
    )
    return b, w, u


def _forward(q, k, v, g, beta, initial_state, chunk_size: int):
    """(o, final state, the chunks' starting states [batch*heads, chunks, key width, value width])."""
    batch, heads, seq_len, key_dim = q.shape
    value_dim = v.shape[-1]
    num_chunks = triton.cdiv(seq_len, chunk_size)
    padded_len = num_chunks * chunk_size
    config = _config(q.dtype, key_dim, value_dim)
    block_v = config["BLOCK_V"]
    precision, _ = _precisions(q.dtype)
    b, w, u = _prepare(k, v, g, beta, chunk_size, config)

    states = torch.empty(batch * heads, num_chunks, key_dim, value_dim, dtype=q.dtype, device=q.device)
    v_new = torch.empty(batch * heads, padded_len, value_dim, dtype=q.dtype, device=q.device)
    final_state = torch.empty(batch, heads, key_dim, value_dim, dtype=torch.float32, device=q.device)
    has_initial = initial_state is not None
    initial = initial_state if has_initial else final_state
    _state_kernel[(value_dim // config["SCAN_V"], batch * heads)](
        k, w, u, b, initial, states, v_new, final_state, *_strides(k, initial), heads, seq_len, num_chunks,
        KEY_DIM=key_dim, VALUE_DIM=value_dim, CHUNK=chunk_size, BLOCK_V=config["SCAN_V"], HAS_INITIAL=has_initial,
        PRECISION=precision, num_warps=config["SCAN_WARPS"], num_stages=config["SCAN_STAGES"],
    )
    o = torch.empty(batch, heads, seq_len, value_dim, dtype=q.dtype, device=q.device)
    _output_kernel[(value_dim // block_v, num_chunks, batch * heads)](
        q, k, b, states, v_new, o, *_strides(q, k), heads, seq_len,
        KEY_DIM=key_dim, VALUE_DIM=value_dim, CHUNK=chunk_size, BLOCK_V=block_v, PRECISION=precision,
        num_warps=config["WARPS"],
    )
    return o, final_state, states


def _backward(q, k, v, g, beta, states, grad_o, grad_final, chunk_size: int):
    """(dq, dk, dv, dg, dbeta, d initial state)."""
    batch, heads, seq_len, key_dim = q.shape
    value_dim = v.shape[-1]
    num_chunks = triton.cdiv(seq_len, chunk_size)
    padded_len = num_chunks * chunk_size
    config = _config(q.dtype, key_dim, value_dim)
    block_k, block_v = config["BLOCK_K"], config["BLOCK_V"]
    precision, solve_precision = _precisions(q.dtype)
    dims = dict(KEY_DIM=key_dim, VALUE_DIM=value_dim, CHUNK=chunk_size)
    empty = lambda *shape, dtype=q.dtype: torch.empty(*shape, dtype=dtype, device=q.device)

    b, w, u = _prepare(k, v, g, beta, chunk_size, config)
    v_new = empty(batch * heads, padded_len, value_dim)
    dv_local = empty(batch * heads, padded_len, value_dim, dtype=torch.float32)
    _backward_local_kernel[(value_dim // block_v, num_chunks, batch * heads)](
        q, k, grad_o, b, w, u, states, v_new, dv_local, *_strides(q, k, grad_o), heads, seq_len,
        **dims, BLOCK_V=block_v, PRECISION=precision, num_warps=config["WARPS"],
    )

    grad_states = torch.empty_like(states)
    dv_new = empty(batch * heads, padded_len, value_dim)
    grad_initial = empty(batch, heads, key_dim, value_dim, dtype=torch.float32)
    _state_grad_kernel[(value_dim // config["SCAN_V"], batch * heads)](
        q, k, grad_o, b, w, dv_local, grad_final, grad_states, dv_new, grad_initial,
        *_strides(q, k, grad_o, grad_final), heads, seq_len, num_chunks,
        **dims, BLOCK_V=config["SCAN_V"], PRECISION=precision, num_warps=config["SCAN_WARPS"],
        num_stages=config["SCAN_STAGES"],
    )

    key_blocks = key_dim // block_k
    dq = empty(batch, heads, seq_len, key_dim)
    dk_part = empty(batch * heads, padded_len, key_dim, dtype=torch.float32)
    dw = empty(batch * heads, padded_len, key_dim)
    dg_part = empty(key_blocks, batch * heads, padded_len, dtype=torch.float32)
    _grad_qk_kernel[(key_blocks, num_chunks, batch * heads)](
        q, k, grad_o, b, states, grad_states, v_new, dv_new, dq, dk_part, dw, dg_part,
        *_strides(q, k, grad_o), heads, seq_len,
        **dims, BLOCK_K=block_k, BLOCK_V=config["STEP_V"], PRECISION=precision, num_warps=config["WARPS"],
    )

    dk = empty(batch, heads, seq_len, key_dim)
    dv = empty(batch, heads, seq_len, value_dim)
    dbeta = empty(batch, heads, seq_len, dtype=torch.float32)
    dg = empty(batch, heads, seq_len, dtype=torch.float32)
    _grad_wy_kernel[(num_chunks, batch * heads)](
        k, v, beta, b, dv_new, dw, dk_part, dg_part, dk, dv, dbeta, dg, *_strides(k, v, beta), heads, seq_len,
        **dims, BLOCK_K=config["STEP_K"], BLOCK_V=config["STEP_V"], KEY_BLOCKS=key_blocks, PRECISION=precision,
        SOLVE_PRECISION=solve_precision,
        num_warps=config["SOLVE_WARPS"],
    )
    return dq, dk, dv, dg, dbeta, grad_initial


class GatedDeltaNetFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: torch.Tensor | None, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        o, final_state, states = _forward(q, k, v, g, beta, initial_state, chunk_size)
        ctx.save_for_backward(q, k, v, g, beta, states)
        ctx.chunk_size = chunk_size
        ctx.has_initial = initial_state is not None
        return o, final_state

    @staticmethod
    def backward(ctx, grad_o: torch.Tensor, grad_final_state: torch.Tensor):
        q, k, v, g, beta, states = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, grad_initial = _backward(q, k, v, g, beta, states, grad_o, grad_final_state,
                                                        ctx.chunk_size)
        return dq, dk, dv, dg, dbeta, grad_initial if ctx.has_initial else None, None


def gated_deltanet_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None,
                           chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, final_state) by the chunked Triton kernels above, differentiable through GatedDeltaNetFunction."""
    check_arguments(q, k, v, g, beta, initial_state, chunk_size)
    return GatedDeltaNetFunction.apply(q, k, v, g, beta, initial_state, int(chunk_size))


def gated_deltanet_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, final_state) one token at a time with a float32 state, differentiable by autograd."""
    check_arguments(q, k, v, g, beta, initial_state)
    batch, heads, seq_len, key_dim = q.shape
    value_dim = v.shape[-1]
    if initial_state is None:
        state = torch.zeros(batch, heads, key_dim, value_dim, dtype=torch.float32, device=q.device)
    else:
        state = initial_state
    outputs = []
    for t in range(seq_len):
        q_t, k_t, v_t = q[:, :, t].float(), k[:, :, t].float(), v[:, :, t].float()
        decay, beta_t = g[:, :, t, None, None].exp(), beta[:, :, t, None, None]
        k_state = torch.einsum("bhk,bhkv->bhv", k_t, state)
        state = decay * (state - beta_t * k_t[..., :, None] * k_state[..., None, :]) \
            + beta_t * k_t[..., :, None] * v_t[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q_t, state))
    return torch.stack(outputs, dim=2).to(q.dtype), state
