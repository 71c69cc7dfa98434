"""DeepSeek sparse attention in Triton: the lightning indexer, the top-k selection, attention over the selected keys.

A lightning indexer scores every past key, each query keeps its top-k, and attention runs over the selected keys
only, forward and backward.

Indexer: one program per (query block, key block, batch) accumulates sum_j w[t, j] relu(q_idx[t, j] . k_idx[s])
over the indexer heads with one tl.dot per head; blocks wholly above the diagonal only store -inf. It is the one
seq^2 part, made cheap by few, narrow heads.
Top-k: torch.topk over int64 keys that hold the score and, below it, the position reversed, so that equal scores
keep the lower key first.
Sparse attention: the key and value of a token are shared by all heads (DeepSeek's MQA form of MLA), so one program
per (query, batch, block of heads) gathers each selected key row once for all its heads: S = Q K_sel^T is a
[heads, BLOCK_N] tile, with the online softmax over the selected keys. HBM (or L2) traffic per query: the topk
indices, topk rows of K and of V, Q and O once: about 2 topk d e bytes, against 2 t d e for dense causal attention.
The backward's program per query rebuilds P from the saved L, writes dQ, and scatters dK and dV rows with float32
atomics into buffers that a last kernel rounds to the input dtype.
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
CAST_BLOCK = 1024


def _interpreted() -> bool:
    return triton.knobs.runtime.interpret


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_tensor(name: str, tensor, ndim: int, dims: str, function: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{function} expects {name} to be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{function} supports dtypes {SUPPORTED_DTYPES}, got {name} of {tensor.dtype}")
    if tensor.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {dims}, got shape {tuple(tensor.shape)}")
    if 0 in tensor.shape:
        raise ValueError(f"every dimension of {name} must be at least 1, got shape {tuple(tensor.shape)}")


def _check_head_dim(name: str, size: int) -> None:
    if not (MIN_HEAD_DIM <= size <= MAX_HEAD_DIM and size % HEAD_DIM_MULTIPLE == 0):
        raise ValueError(f"{name} must be a multiple of {HEAD_DIM_MULTIPLE} from {MIN_HEAD_DIM} to {MAX_HEAD_DIM}, "
                         f"got {size}")


def _check_devices(function: str, *tensors) -> None:
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{function}'s tensors must be on one device, got {[str(t.device) for t in tensors]}")


# --- the lightning indexer ---------------------------------------------------------------------------------------


def _indexer_config() -> dict:
    if _interpreted():
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)


@triton.jit
def _indexer_kernel(q_ptr, k_ptr, w_ptr, out_ptr,
                    stride_qb, stride_qt, stride_qh, stride_qd, stride_kb, stride_kt, stride_kd,
                    stride_wb, stride_wt, stride_wh, seq_len, index_heads, index_dim,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    query_start, key_start, batch = tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N, tl.program_id(2)
    query_rows = query_start + tl.arange(0, BLOCK_M)
    key_rows = key_start + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    out_ptrs = out_ptr + batch * seq_len * seq_len + query_rows[:, None] * seq_len + key_rows[None, :]
    in_bounds = (query_rows[:, None] < seq_len) & (key_rows[None, :] < seq_len)
    if key_start > query_start + BLOCK_M - 1:  # every key of the block is in every query's future
        tl.store(out_ptrs, tl.full([BLOCK_M, BLOCK_N], -float("inf"), tl.float32), mask=in_bounds)
        return
    k = tl.load(k_ptr + batch * stride_kb + key_rows[:, None] * stride_kt + cols[None, :] * stride_kd,
                mask=(key_rows[:, None] < seq_len) & (cols[None, :] < index_dim), other=0.0)
    q_base = q_ptr + batch * stride_qb + query_rows[:, None] * stride_qt + cols[None, :] * stride_qd
    q_mask = (query_rows[:, None] < seq_len) & (cols[None, :] < index_dim)
    w_base = w_ptr + batch * stride_wb + query_rows * stride_wt
    scores = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for head in range(index_heads):
        q = tl.load(q_base + head * stride_qh, mask=q_mask, other=0.0)
        weight = tl.load(w_base + head * stride_wh, mask=query_rows < seq_len, other=0.0).to(tl.float32)
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores += weight[:, None] * tl.maximum(logits, 0.0)
    scores = tl.where(key_rows[None, :] <= query_rows[:, None], scores, -float("inf"))
    tl.store(out_ptrs, scores, mask=in_bounds)


def check_indexer_arguments(q_idx, k_idx, weights) -> None:
    function = "indexer_scores"
    _check_tensor("q_idx", q_idx, 4, "[batch, seq, index_heads, index_dim]", function)
    _check_tensor("k_idx", k_idx, 3, "[batch, seq, index_dim]", function)
    _check_tensor("weights", weights, 3, "[batch, seq, index_heads]", function)
    if not q_idx.dtype == k_idx.dtype == weights.dtype:
        raise TypeError(f"q_idx, k_idx and weights must share one dtype, got {q_idx.dtype}, {k_idx.dtype} and "
                        f"{weights.dtype}")
    batch, seq_len, index_heads, index_dim = q_idx.shape
    if tuple(k_idx.shape) != (batch, seq_len, index_dim):
        raise ValueError(f"k_idx must have shape {(batch, seq_len, index_dim)}, got {tuple(k_idx.shape)}")
    if tuple(weights.shape) != (batch, seq_len, index_heads):
        raise ValueError(f"weights must have shape {(batch, seq_len, index_heads)}, got {tuple(weights.shape)}")
    _check_head_dim("index_dim", index_dim)
    _check_devices(function, q_idx, k_idx, weights)


def indexer_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """I[b, t, s] = sum_j weights[b, t, j] relu(q_idx[b, t, j] . k_idx[b, s]) for s <= t, -inf above, float32.
    No scale: DeepSeek-V3.2's code folds 1 / sqrt(index_heads * index_dim) into the weights, the contract does not."""
    check_indexer_arguments(q_idx, k_idx, weights)
    batch, seq_len, index_heads, index_dim = q_idx.shape
    config = _indexer_config()
    scores = torch.empty(batch, seq_len, seq_len, dtype=torch.float32, device=q_idx.device)
    grid = (triton.cdiv(seq_len, config["BLOCK_M"]), triton.cdiv(seq_len, config["BLOCK_N"]), batch)
    _indexer_kernel[grid](q_idx, k_idx, weights, scores, *q_idx.stride(), *k_idx.stride(), *weights.stride(),
                          seq_len, index_heads, index_dim, BLOCK_D=triton.next_power_of_2(index_dim),
                          PRECISION=_precision(q_idx.dtype), **config)
    return scores


# --- top-k selection ---------------------------------------------------------------------------------------------


def check_topk_arguments(scores, topk) -> None:
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"select_topk expects scores to be a torch.Tensor, got {type(scores).__name__}")
    if scores.dtype != torch.float32:
        raise TypeError(f"scores must be float32, got {scores.dtype}")
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise TypeError(f"topk must be a Python int, got {type(topk).__name__}")
    if scores.ndim != 3 or scores.shape[1] != scores.shape[2]:
        raise ValueError(f"scores must be [batch, seq, seq], got shape {tuple(scores.shape)}")
    if 0 in scores.shape:
        raise ValueError(f"every dimension of scores must be at least 1, got shape {tuple(scores.shape)}")
    if topk < 1:
        raise ValueError(f"topk must be at least 1, got {topk}")


def _tie_broken_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys that order like the scores [..., seq] and, between equal scores, put the lower position first: the
    score's float32 bits made monotonic as a signed int32 in the high half, seq - 1 - position in the low half.
    torch.topk over them selects exactly, faster than a stable sort of the rows (53 against 72 ms at seq 32768)."""
    bits = (scores + 0.0).view(torch.int32).to(torch.int64)  # + 0.0 turns -0.0 into 0.0: equal scores, equal keys
    monotonic = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: reverse the order of the rest
    seq_len = scores.shape[-1]
    return monotonic * 2**32 + (seq_len - 1 - torch.arange(seq_len, device=scores.device))


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Each query's topk highest-scoring keys s <= t (equal scores: the lower s first), ascending, -1 padded: the
    scores choose the keys, never their order (DeepSeek-V3.2's code keeps torch.topk's, highest first)."""
    check_topk_arguments(scores, topk)
    batch, seq_len, _ = scores.shape
    positions = torch.arange(seq_len, device=scores.device)
    future = positions[None, :] > positions[:, None]
    candidates = scores.masked_fill(future, -math.inf)
    kept = min(topk, seq_len)
    order = torch.topk(_tie_broken_keys(candidates), kept, dim=-1).indices
    # Query t has t + 1 candidates: the positions past them hold future keys, which become the -1 padding.
    order = order.masked_fill(positions[None, :kept] > positions[:, None], seq_len)
    selected = torch.sort(order, dim=-1).values
    selected = selected.masked_fill(selected == seq_len, -1)
    if kept < topk:
        selected = torch.cat([selected, selected.new_full((batch, seq_len, topk - kept), -1)], dim=-1)
    return selected


# --- attention over the selected keys ----------------------------------------------------------------------------


def _heads_block(heads: int) -> int:
    """The query heads one program serves, forward and backward alike: all the heads up to 64, since every head of
    the block reuses each gathered K and V row (and the backward adds each row's dK and dV once for the whole block);
    at least 16, the smallest side tl.dot takes."""
    return max(16, min(64, triton.next_power_of_2(heads)))


def _forward_config(dtype: torch.dtype, heads: int, head_dim_block: int) -> dict:
    heads_block = _heads_block(heads)
    if _interpreted():
        return dict(BLOCK_H=heads_block, BLOCK_N=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_H=min(heads_block, 32), BLOCK_N=32, num_warps=4, num_stages=2)
    # On the H200 (bfloat16, T = 8192): 1.85 ms at 64 heads, 0.41 ms at 16 heads; 8 warps or 3 stages are slower.
    return dict(BLOCK_H=heads_block, BLOCK_N=64, num_warps=4, num_stages=2)


def _backward_config(dtype: torch.dtype, heads: int, head_dim_block: int) -> dict:
    heads_block = _heads_block(heads)
    if _interpreted():
        return dict(BLOCK_H=heads_block, BLOCK_N=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_H=min(heads_block, 32), BLOCK_N=16, num_warps=4, num_stages=1)
    # On the H200 (bfloat16, T = 8192): 7.8 ms at 64 heads (64 x 32 blocks), 1.6 ms at 16 heads (16 x 64 blocks).
    return dict(BLOCK_H=heads_block, BLOCK_N=32 if heads_block >= 64 else 64, num_warps=4, num_stages=1)


@triton.jit
def _gather_rows(ptr, rows, valid, cols, row_stride, col_stride, head_dim):
    """[BLOCK_N, BLOCK_D]: the rows named by `rows` (zeros where not valid)."""
    return tl.load(ptr + rows[:, None] * row_stride + cols[None, :] * col_stride,
                   mask=valid[:, None] & (cols[None, :] < head_dim), other=0.0)


@triton.jit
def _gather_block(idx_base, stride_in, start, n_selected, k_base, v_base, cols, stride_kt, stride_kd,
                  stride_vt, stride_vd, head_dim, BLOCK_N: tl.constexpr):
    """The loop head of forward and backward: the query's index slots [start, start + BLOCK_N), which of them name a
    key (slots past n_selected and -1 padding do not), and the K and V rows they name, [BLOCK_N, BLOCK_D] each.
    Memory traffic: BLOCK_N indices, then one row of K and one of V per valid slot, read once for all the heads of
    the program's block; padded slots load nothing."""
    slots = start + tl.arange(0, BLOCK_N)
    keys = tl.load(idx_base + slots * stride_in, mask=slots < n_selected, other=-1)
    valid = keys >= 0
    k = _gather_rows(k_base, keys, valid, cols, stride_kt, stride_kd, head_dim)
    v = _gather_rows(v_base, keys, valid, cols, stride_vt, stride_vd, head_dim)
    return keys, valid, k, v


@triton.jit
def _head_tile(ptr, heads, cols, head_stride, col_stride, n_heads, head_dim):
    """[BLOCK_H, BLOCK_D]: one query's rows of the heads in `heads`."""
    return tl.load(ptr + heads[:, None] * head_stride + cols[None, :] * col_stride,
                   mask=(heads[:, None] < n_heads) & (cols[None, :] < head_dim), other=0.0)


@triton.jit
def _forward_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, o_ptr, lse_ptr,
                    stride_qb, stride_qt, stride_qh, stride_qd, stride_kb, stride_kt, stride_kd,
                    stride_vb, stride_vt, stride_vd, stride_ib, stride_it, stride_in,
                    n_heads, head_dim, n_selected, scale_log2,
                    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    query, batch = tl.program_id(0), tl.program_id(1)
    seq_len = tl.num_programs(0)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    q = _head_tile(q_ptr + batch * stride_qb + query * stride_qt, heads, cols, stride_qh, stride_qd, n_heads,
                   head_dim)
    k_base, v_base = k_ptr + batch * stride_kb, v_ptr + batch * stride_vb
    idx_base = idx_ptr + batch * stride_ib + query * stride_it
    # The running max starts finite: a block of padding only (-1 everywhere) then leaves every row unchanged.
    row_max = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start in range(0, n_selected, BLOCK_N):
        keys, valid, k, v = _gather_block(idx_base, stride_in, start, n_selected, k_base, v_base, cols, stride_kt,
                                          stride_kd, stride_vt, stride_vd, head_dim, BLOCK_N)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        scores = tl.where(valid[None, :], scores, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        row_max = new_max
    acc = acc / row_sum[:, None]
    o_ptrs = o_ptr + ((batch * seq_len + query) * n_heads + heads[:, None]) * head_dim + cols[None, :]
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=(heads[:, None] < n_heads) & (cols[None, :] < head_dim))
    tl.store(lse_ptr + (batch * seq_len + query) * n_heads + heads, (row_max + tl.log2(row_sum)) * _LN_2,
             mask=heads < n_heads)


@triton.jit
def _backward_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, o_ptr, do_ptr, lse_ptr, dq_ptr, dk_ptr, dv_ptr,
                     stride_qb, stride_qt, stride_qh, stride_qd, stride_kb, stride_kt, stride_kd,
                     stride_vb, stride_vt, stride_vd, stride_ib, stride_it, stride_in,
                     stride_dob, stride_dot, stride_doh, stride_dod,
                     n_heads, head_dim, n_selected, scale, scale_log2,
                     BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    query, batch = tl.program_id(0), tl.program_id(1)
    seq_len = tl.num_programs(0)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    head_mask = heads < n_heads
    row = (batch * seq_len + query) * n_heads  # o, L and dq are contiguous [batch, seq, heads(, head_dim)]
    q = _head_tile(q_ptr + batch * stride_qb + query * stride_qt, heads, cols, stride_qh, stride_qd, n_heads,
                   head_dim)
    do = _head_tile(do_ptr + batch * stride_dob + query * stride_dot, heads, cols, stride_doh, stride_dod, n_heads,
                    head_dim)
    o = _head_tile(o_ptr + row * head_dim, heads, cols, head_dim, 1, n_heads, head_dim)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # D = rowsum(O * dO), one query's rows
    lse_log2 = tl.load(lse_ptr + row + heads, mask=head_mask, other=0.0) * _LOG2_E
    k_base, v_base = k_ptr + batch * stride_kb, v_ptr + batch * stride_vb
    # dk and dv are float32 contiguous [batch, seq, head_dim] buffers.
    dk_base, dv_base = dk_ptr + batch * seq_len * head_dim, dv_ptr + batch * seq_len * head_dim
    idx_base = idx_ptr + batch * stride_ib + query * stride_it
    dq = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start in range(0, n_selected, BLOCK_N):
        keys, valid, k, v = _gather_block(idx_base, stride_in, start, n_selected, k_base, v_base, cols, stride_kt,
                                          stride_kd, stride_vt, stride_vd, head_dim, BLOCK_N)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        probs = tl.where(valid[None, :], tl.exp2(scores - lse_log2[:, None]), 0.0)
        dprobs = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        dscores = probs * (dprobs - delta[:, None])
        dq += tl.dot(dscores.to(k.dtype), k, input_precision=PRECISION)
        dv = tl.dot(tl.trans(probs.to(do.dtype)), do, input_precision=PRECISION)
        dk = tl.dot(tl.trans(dscores.to(q.dtype)), q, input_precision=PRECISION) * scale
        # Other queries select the same keys: their rows of dK and dV are sums, accumulated with atomics.
        row_mask = valid[:, None] & (cols[None, :] < head_dim)
        # Relaxed: no ordering is needed between the adds (acq_rel, the default, fences every one of them).
        tl.atomic_add(dk_base + keys[:, None] * head_dim + cols[None, :], dk, mask=row_mask, sem="relaxed")
        tl.atomic_add(dv_base + keys[:, None] * head_dim + cols[None, :], dv, mask=row_mask, sem="relaxed")
    tl.store(dq_ptr + (row + heads[:, None]) * head_dim + cols[None, :], (dq * scale).to(dq_ptr.dtype.element_ty),
             mask=head_mask[:, None] & (cols[None, :] < head_dim))


@triton.jit
def _round_kernel(src_ptr, dst_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(src_ptr + offsets, mask=offsets < numel)
    tl.store(dst_ptr + offsets, values.to(dst_ptr.dtype.element_ty), mask=offsets < numel)


def _forward(q, k, v, indices):
    batch, seq_len, heads, head_dim = q.shape
    head_dim_block = triton.next_power_of_2(head_dim)
    config = _forward_config(q.dtype, heads, head_dim_block)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    grid = (seq_len, batch, triton.cdiv(heads, config["BLOCK_H"]))
    _forward_kernel[grid](q, k, v, indices, o, lse, *q.stride(), *k.stride(), *v.stride(), *indices.stride(),
                          heads, head_dim, indices.shape[-1], LOG2_E / math.sqrt(head_dim), BLOCK_D=head_dim_block,
                          PRECISION=_precision(q.dtype), **config)
    return o, lse


def _backward(q, k, v, o, lse, indices, grad_o):
    batch, seq_len, heads, head_dim = q.shape
    head_dim_block = triton.next_power_of_2(head_dim)
    config = _backward_config(q.dtype, heads, head_dim_block)
    scale = 1.0 / math.sqrt(head_dim)
    grad_q = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    sums = torch.zeros(2, batch, seq_len, head_dim, dtype=torch.float32, device=q.device)  # dK and dV, float32
    grid = (seq_len, batch, triton.cdiv(heads, config["BLOCK_H"]))
    _backward_kernel[grid](q, k, v, indices, o, grad_o, lse, grad_q, sums[0], sums[1], *q.stride(), *k.stride(),
                           *v.stride(), *indices.stride(), *grad_o.stride(), heads, head_dim, indices.shape[-1],
                           scale, scale * LOG2_E, BLOCK_D=head_dim_block, PRECISION=_precision(q.dtype), **config)
    rounded = torch.empty(sums.shape, dtype=k.dtype, device=k.device)
    _round_kernel[(triton.cdiv(sums.numel(), CAST_BLOCK),)](sums, rounded, sums.numel(), BLOCK=CAST_BLOCK)
    return grad_q, rounded[0], rounded[1]


class SparseAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        o, lse = _forward(q, k, v, indices)
        ctx.save_for_backward(q, k, v, o, lse, indices)
        return o

    @staticmethod
    def backward(ctx, grad_o: torch.Tensor):
        q, k, v, o, lse, indices = ctx.saved_tensors
        return (*_backward(q, k, v, o, lse, indices, grad_o), None)


def check_attention_arguments(q, k, v, indices) -> None:
    function = "sparse_attention"
    _check_tensor("q", q, 4, "[batch, seq, heads, head_dim]", function)
    _check_tensor("k", k, 3, "[batch, seq, head_dim]", function)
    _check_tensor("v", v, 3, "[batch, seq, head_dim]", function)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int64:
        raise TypeError(f"indices must be an int64 torch.Tensor, got "
                        f"{indices.dtype if isinstance(indices, torch.Tensor) else type(indices).__name__}")
    batch, seq_len, _, head_dim = q.shape
    if tuple(k.shape) != (batch, seq_len, head_dim) or tuple(v.shape) != (batch, seq_len, head_dim):
        raise ValueError(f"k and v must have shape {(batch, seq_len, head_dim)}, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if indices.ndim != 3 or tuple(indices.shape[:2]) != (batch, seq_len) or indices.shape[2] == 0:
        raise ValueError(f"indices must have shape ({batch}, {seq_len}, topk) with topk >= 1, got "
                         f"{tuple(indices.shape)}")
    _check_head_dim("head_dim", head_dim)
    _check_devices(function, q, k, v, indices)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Attention of each query over the keys its row of `indices` names, by the Triton kernels above."""
    check_attention_arguments(q, k, v, indices)
    return SparseAttentionFunction.apply(q, k, v, indices)


def deepseek_sparse_attention(q, k, v, q_idx, k_idx, weights, topk: int) -> torch.Tensor:
    """The three steps: the indexer's scores and their top-k, then attention over the selected keys."""
    with torch.no_grad():
        indices = select_topk(indexer_scores(q_idx, k_idx, weights), topk)
    return sparse_attention(q, k, v, indices)


def sparse_attention_torch(q, k, v, indices):
    """The plain formula with a [seq, seq] mask built from the indices: the oracle (run at float64)."""
    batch, seq_len, heads, head_dim = q.shape
    visible = torch.zeros(batch, seq_len, seq_len + 1, dtype=torch.bool, device=q.device)
    visible.scatter_(2, torch.where(indices < 0, seq_len, indices), True)
    visible = visible[..., :seq_len]
    scores = torch.einsum("bthd,bsd->bhts", q, k) / math.sqrt(head_dim)
    scores = scores.masked_fill(~visible[:, None], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    o = torch.einsum("bhts,bsd->bthd", torch.softmax(scores, dim=-1), v)
    return o, lse.transpose(1, 2)


def indexer_scores_torch(q_idx, k_idx, weights):
    """The plain indexer formula: the oracle (run at float64)."""
    logits = torch.einsum("bthd,bsd->bths", q_idx, k_idx)
    scores = torch.einsum("bth,bths->bts", weights, torch.relu(logits))
    seq_len = q_idx.shape[1]
    future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q_idx.device).triu(1)
    return scores.masked_fill(future, -math.inf)
