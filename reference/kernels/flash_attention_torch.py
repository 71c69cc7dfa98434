"""FlashAttention-2 forward and backward as plain PyTorch loops over tiles, and attention written out in full.

`flash_attention` never holds more than one TILE_SIZE x TILE_SIZE block of scores per (batch, head): the forward
keeps a running max and sum per query (the online softmax) and saves only the logsumexp L of each row; the backward
rebuilds each block of probabilities from L. Leading dims are batched in every matmul, so the Python loops run over
tiles only. `flash_attention_torch` is the textbook formula, used by the grader at float64.
"""

import math

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Queries and keys are both tiled in blocks of this many rows (the last block of each may be shorter).
TILE_SIZE = 16
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 128
HEAD_DIM_MULTIPLE = 16


def check_arguments(q, k, v, allowed_dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> None:
    """The contract's argument checks, shared by every implementation in the reference."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"flash_attention expects {name} to be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in allowed_dtypes:
            raise TypeError(f"flash_attention supports dtypes {allowed_dtypes}, got {name} of {tensor.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if q.ndim not in (3, 4):
        raise ValueError(f"q must be [batch, heads, seq, head_dim] or [batch*heads, seq, head_dim], got {q.ndim}-D")
    if k.shape[-2] != q.shape[-2] or v.shape[-2] != q.shape[-2]:
        raise ValueError(f"query and key lengths must be equal, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k and v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if 0 in q.shape:
        raise ValueError(f"every dimension must be at least 1, got shape {tuple(q.shape)}")
    head_dim = q.shape[-1]
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_MULTIPLE == 0):
        raise ValueError(f"head_dim must be a multiple of {HEAD_DIM_MULTIPLE} from {MIN_HEAD_DIM} to {MAX_HEAD_DIM}, "
                         f"got {head_dim}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")


def _tiles(length: int, first: int = 0):
    """(start, end) of the tiles from `first` (a multiple of TILE_SIZE) to `length`."""
    for start in range(first, length, TILE_SIZE):
        yield start, min(start + TILE_SIZE, length)


def _causal_visible(q_start: int, q_end: int, k_start: int, k_end: int, device) -> torch.Tensor:
    """Bool [q_end - q_start, k_end - k_start]: query i sees key j iff j <= i."""
    rows = torch.arange(q_start, q_end, device=device)
    cols = torch.arange(k_start, k_end, device=device)
    return cols[None, :] <= rows[:, None]


def _forward(q, k, v, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o in q's dtype, L in float32): every product and sum in float32."""
    seq_len, head_dim = q.shape[-2:]
    scale = 1.0 / math.sqrt(head_dim)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for q_start, q_end in _tiles(seq_len):
        q_tile = q[..., q_start:q_end, :].float()
        row_max = torch.full(q_tile.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros_like(q_tile)
        # Causal: key tiles that start past the last query of this tile are invisible to all of it.
        for k_start, k_end in _tiles(q_end if is_causal else seq_len):
            scores = q_tile @ k[..., k_start:k_end, :].float().transpose(-1, -2) * scale
            if is_causal and k_end - 1 > q_start:
                scores = scores.masked_fill(~_causal_visible(q_start, q_end, k_start, k_end, q.device), -math.inf)
            # Key 0 is in the first tile and visible to every query, so the max is finite from the first tile on.
            new_max = torch.maximum(row_max, scores.amax(dim=-1))
            rescale = torch.exp(row_max - new_max)
            probs = torch.exp(scores - new_max[..., None])
            row_sum = row_sum * rescale + probs.sum(dim=-1)
            acc = acc * rescale[..., None] + probs @ v[..., k_start:k_end, :].float()
            row_max = new_max
        o[..., q_start:q_end, :] = (acc / row_sum[..., None]).to(q.dtype)
        lse[..., q_start:q_end] = row_max + torch.log(row_sum)
    return o, lse


def _backward(q, k, v, o, lse, grad_o, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seq_len, head_dim = q.shape[-2:]
    scale = 1.0 / math.sqrt(head_dim)
    # D_i = sum_c O_ic dO_ic = sum_j P_ij dP_ij: the softmax backward's row term, one pass before the tiles.
    delta = (o.float() * grad_o.float()).sum(dim=-1)
    grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grad_k = torch.zeros_like(grad_q)
    grad_v = torch.zeros_like(grad_q)
    for k_start, k_end in _tiles(seq_len):
        k_tile = k[..., k_start:k_end, :].float()
        v_tile = v[..., k_start:k_end, :].float()
        # Causal: query tiles that end before this key tile starts see none of it.
        for q_start, q_end in _tiles(seq_len, first=k_start if is_causal else 0):
            q_tile = q[..., q_start:q_end, :].float()
            grad_o_tile = grad_o[..., q_start:q_end, :].float()
            scores = q_tile @ k_tile.transpose(-1, -2) * scale
            probs = torch.exp(scores - lse[..., q_start:q_end, None])
            if is_causal and k_end - 1 > q_start:
                probs = probs.masked_fill(~_causal_visible(q_start, q_end, k_start, k_end, q.device), 0.0)
            grad_v[..., k_start:k_end, :] += probs.transpose(-1, -2) @ grad_o_tile
            grad_probs = grad_o_tile @ v_tile.transpose(-1, -2)
            grad_scores = probs * (grad_probs - delta[..., q_start:q_end, None])
            grad_q[..., q_start:q_end, :] += grad_scores @ k_tile * scale
            grad_k[..., k_start:k_end, :] += grad_scores.transpose(-1, -2) @ q_tile * scale
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
        o, lse = _forward(q, k, v, is_causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, grad_o: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = _backward(q, k, v, o, lse, grad_o, ctx.is_causal)
        return grad_q, grad_k, grad_v, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v by tiles, differentiable through FlashAttentionFunction."""
    check_arguments(q, k, v)
    return FlashAttentionFunction.apply(q, k, v, is_causal)


def flash_attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, L) written out with the full score matrix, in q's dtype (float64 too), differentiable by autograd."""
    check_arguments(q, k, v, SUPPORTED_DTYPES + (torch.float64,))
    seq_len, head_dim = q.shape[-2:]
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    if is_causal:
        scores = scores.masked_fill(~_causal_visible(0, seq_len, 0, seq_len, q.device), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v, lse
