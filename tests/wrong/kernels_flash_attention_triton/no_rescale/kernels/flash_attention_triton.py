"""FlashAttention-2, forward and backward, written in Triton.

Wrong on purpose: when a key block raises the running max, the running sum is rescaled but the output accumulator is
not.
"""

import math

import torch
import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_N = 16


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, N, D, scale, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    base = bh * N * D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m[:, None] < N) & (offs_d[None, :] < D)
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :], mask=q_mask, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if IS_CAUSAL:
        end_n = tl.minimum(start_m + BLOCK_M, N)
    else:
        end_n = N
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < N) & (offs_d[None, :] < D)
        k = tl.load(K + base + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        valid = offs_n[None, :] < N
        if IS_CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + base + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + base + offs_m[:, None] * D + offs_d[None, :], acc.to(O.dtype.element_ty), mask=q_mask)
    tl.store(LSE + bh * N + offs_m, m_i + tl.log(l_i), mask=offs_m < N)


@triton.jit
def _bwd_delta_kernel(O, DO, DELTA, N, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < N) & (offs_d[None, :] < D)
    ptrs = bh * N * D + offs_m[:, None] * D + offs_d[None, :]
    o = tl.load(O + ptrs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + bh * N + offs_m, tl.sum(o * do, 1), mask=offs_m < N)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, N, D, scale, IS_CAUSAL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     PRECISION: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    base = bh * N * D
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < N) & (offs_d[None, :] < D)
    k = tl.load(K + base + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + base + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if IS_CAUSAL:
        start_m_loop = (start_n // BLOCK_M) * BLOCK_M
    else:
        start_m_loop = 0
    for start_m in range(start_m_loop, N, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_mask = (offs_m[:, None] < N) & (offs_d[None, :] < D)
        q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :], mask=q_mask, other=0.0)
        do = tl.load(DO + base + offs_m[:, None] * D + offs_d[None, :], mask=q_mask, other=0.0)
        lse = tl.load(LSE + bh * N + offs_m, mask=offs_m < N, other=0.0)
        delta = tl.load(DELTA + bh * N + offs_m, mask=offs_m < N, other=0.0)
        # Transposed tile: keys are rows, queries are columns.
        pT = tl.exp(tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale - lse[None, :])
        valid = offs_m[None, :] < N
        if IS_CAUSAL:
            valid = valid & (offs_n[:, None] <= offs_m[None, :])
        pT = tl.where(valid, pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do, input_precision=PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(q.dtype), q, input_precision=PRECISION)
    tl.store(DK + base + offs_n[:, None] * D + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + base + offs_n[:, None] * D + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, N, D, scale, IS_CAUSAL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    base = bh * N * D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m[:, None] < N) & (offs_d[None, :] < D)
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + base + offs_m[:, None] * D + offs_d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + bh * N + offs_m, mask=offs_m < N, other=0.0)
    delta = tl.load(DELTA + bh * N + offs_m, mask=offs_m < N, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if IS_CAUSAL:
        end_n = tl.minimum(start_m + BLOCK_M, N)
    else:
        end_n = N
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < N) & (offs_d[None, :] < D)
        k = tl.load(K + base + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + base + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        p = tl.exp(tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale - lse[:, None])
        valid = offs_n[None, :] < N
        if IS_CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + base + offs_m[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


def _check(q, k, v):
    for t in (q, k, v):
        if not isinstance(t, torch.Tensor):
            raise TypeError("q, k and v must be tensors")
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"unsupported dtype {t.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError("q, k and v must have one dtype")
    if q.ndim not in (3, 4):
        raise ValueError("q must be 3-D or 4-D")
    if q.shape != k.shape or q.shape != v.shape:
        raise ValueError("q, k and v must have one shape")
    if 0 in q.shape:
        raise ValueError("empty input")
    if q.shape[-1] % 16 or not 16 <= q.shape[-1] <= 128:
        raise ValueError("head_dim must be a multiple of 16 in [16, 128]")
    if not q.device == k.device == v.device:
        raise ValueError("q, k and v must be on one device")


def _flat(t):
    # [batch*heads, seq, head_dim], contiguous.
    return t.reshape(-1, t.shape[-2], t.shape[-1]).contiguous()


def _precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
        qf, kf, vf = _flat(q), _flat(k), _flat(v)
        bh, n, d = qf.shape
        o = torch.empty_like(qf)
        lse = torch.empty((bh, n), dtype=torch.float32, device=q.device)
        grid = (triton.cdiv(n, BLOCK_M), bh)
        _fwd_kernel[grid](qf, kf, vf, o, lse, n, d, 1.0 / math.sqrt(d), IS_CAUSAL=is_causal, BLOCK_M=BLOCK_M,
                          BLOCK_N=BLOCK_N, BLOCK_D=triton.next_power_of_2(d), PRECISION=_precision(q.dtype))
        o = o.view(q.shape)
        lse = lse.view(q.shape[:-1])
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, grad_o: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        qf, kf, vf, of, dof = _flat(q), _flat(k), _flat(v), _flat(o), _flat(grad_o)
        bh, n, d = qf.shape
        block_d = triton.next_power_of_2(d)
        delta = torch.empty((bh, n), dtype=torch.float32, device=q.device)
        _bwd_delta_kernel[(triton.cdiv(n, BLOCK_M), bh)](of, dof, delta, n, d, BLOCK_M=BLOCK_M, BLOCK_D=block_d)
        dq, dk, dv = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf)
        meta = dict(IS_CAUSAL=ctx.is_causal, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=block_d,
                    PRECISION=_precision(q.dtype))
        _bwd_dkdv_kernel[(triton.cdiv(n, BLOCK_N), bh)](qf, kf, vf, dof, lse, delta, dk, dv, n, d,
                                                         1.0 / math.sqrt(d), **meta)
        _bwd_dq_kernel[(triton.cdiv(n, BLOCK_M), bh)](qf, kf, vf, dof, lse, delta, dq, n, d,
                                                       1.0 / math.sqrt(d), **meta)
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    _check(q, k, v)
    return FlashAttentionFunction.apply(q, k, v, is_causal)
