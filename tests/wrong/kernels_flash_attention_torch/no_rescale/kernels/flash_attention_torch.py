"""FlashAttention-2, forward and backward, written as plain PyTorch loops over tiles.

Wrong on purpose: when a key tile raises the running max, the running sum is rescaled but the output accumulator is
not.
"""

import math

import torch

# Queries and keys are both tiled in blocks of this many rows (the last block of each may be shorter).
TILE_SIZE = 16


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


def _causal_mask(i0, i1, j0, j1, device):
    # True where key j is visible to query i, for one tile.
    return torch.arange(j0, j1, device=device)[None, :] <= torch.arange(i0, i1, device=device)[:, None]


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
        n, d = q.shape[-2:]
        scale = 1.0 / math.sqrt(d)
        qf, kf, vf = q.float(), k.float(), v.float()
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        for i0 in range(0, n, TILE_SIZE):
            i1 = min(i0 + TILE_SIZE, n)
            qi = qf[..., i0:i1, :]
            m = torch.full(qi.shape[:-1], float("-inf"), device=q.device)
            l = torch.zeros(qi.shape[:-1], device=q.device)
            acc = torch.zeros(qi.shape, device=q.device)
            last = i1 if is_causal else n
            for j0 in range(0, last, TILE_SIZE):
                j1 = min(j0 + TILE_SIZE, n)
                s = qi @ kf[..., j0:j1, :].transpose(-1, -2) * scale
                if is_causal:
                    s = s.masked_fill(~_causal_mask(i0, i1, j0, j1, q.device), float("-inf"))
                m_new = torch.maximum(m, s.amax(-1))
                p = torch.exp(s - m_new[..., None])
                alpha = torch.exp(m - m_new)
                l = alpha * l + p.sum(-1)
                acc = acc + p @ vf[..., j0:j1, :]
                m = m_new
            out[..., i0:i1, :] = acc / l[..., None]
            lse[..., i0:i1] = m + torch.log(l)
        o = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, grad_o: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        n, d = q.shape[-2:]
        scale = 1.0 / math.sqrt(d)
        qf, kf, vf, do = q.float(), k.float(), v.float(), grad_o.float()
        delta = (o.float() * do).sum(-1)
        dq = torch.zeros(q.shape, device=q.device)
        dk = torch.zeros(q.shape, device=q.device)
        dv = torch.zeros(q.shape, device=q.device)
        # dK and dV: for each key tile, sum over the query tiles that can see it.
        for j0 in range(0, n, TILE_SIZE):
            j1 = min(j0 + TILE_SIZE, n)
            for i0 in range(j0 if ctx.is_causal else 0, n, TILE_SIZE):
                i1 = min(i0 + TILE_SIZE, n)
                s = qf[..., i0:i1, :] @ kf[..., j0:j1, :].transpose(-1, -2) * scale
                p = torch.exp(s - lse[..., i0:i1, None])
                if ctx.is_causal:
                    p = p.masked_fill(~_causal_mask(i0, i1, j0, j1, q.device), 0.0)
                dv[..., j0:j1, :] += p.transpose(-1, -2) @ do[..., i0:i1, :]
                dp = do[..., i0:i1, :] @ vf[..., j0:j1, :].transpose(-1, -2)
                ds = p * (dp - delta[..., i0:i1, None])
                dk[..., j0:j1, :] += ds.transpose(-1, -2) @ qf[..., i0:i1, :] * scale
        # dQ: for each query tile, sum over the key tiles it can see.
        for i0 in range(0, n, TILE_SIZE):
            i1 = min(i0 + TILE_SIZE, n)
            for j0 in range(0, i1 if ctx.is_causal else n, TILE_SIZE):
                j1 = min(j0 + TILE_SIZE, n)
                s = qf[..., i0:i1, :] @ kf[..., j0:j1, :].transpose(-1, -2) * scale
                p = torch.exp(s - lse[..., i0:i1, None])
                if ctx.is_causal:
                    p = p.masked_fill(~_causal_mask(i0, i1, j0, j1, q.device), 0.0)
                dp = do[..., i0:i1, :] @ vf[..., j0:j1, :].transpose(-1, -2)
                ds = p * (dp - delta[..., i0:i1, None])
                dq[..., i0:i1, :] += ds @ kf[..., j0:j1, :] * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    _check(q, k, v)
    return FlashAttentionFunction.apply(q, k, v, is_causal)
