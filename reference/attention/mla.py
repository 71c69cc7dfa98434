"""Multi-head latent attention (DeepSeek-V2): a naive path and an absorbed decode path.

Keys and values are rebuilt from one cached latent vector per token, beside a decoupled rotary key shared by every
head: the naive path materialises every head's keys and values, the decode path never does.

Per token t (h_t of size d_model), per head i of H, with d_h the head size, d_c the latent size, d_r the RoPE size:
    c_t   = W_DKV h_t                       [d_c]   the latent: all a decoder caches of the keys and values,
    k^R_t = RoPE_t(W_KR h_t)                [d_r]   ... beside this rotary key, shared by all heads;
    k_t,i = W_UK,i c_t,  v_t,i = W_UV,i c_t [d_h]   (W_UK,i, W_UV,i: rows i d_h .. (i+1) d_h of W_UK, W_UV)
    [q_t,i ; q^R_t,i] = W_Q,i h_t           [d_h + d_r], then q^R_t,i <- RoPE_t(q^R_t,i)
    score(t, s, i) = (q_t,i . k_s,i + q^R_t,i . k^R_s) / sqrt(d_h + d_r),   s <= t
    o_t = W_O [o_t,1 ; ... ; o_t,H],  o_t,i = sum_s softmax_s(score(t, s, i)) v_s,i
RoPE_t rotates pairs (x_j, x_{j + d_r/2}) by the angle t * base^(-2j / d_r), j < d_r / 2, base 10000: the
half-split convention, positions counted from 0.

Decode path: q_t,i . k_s,i = (W_UK,i^T q_t,i) . c_s, so a query is moved into the latent space once and scored
against the cached latents directly; and W_O,i W_UV,i sum_s p_s c_s gives head i's output from the weighted sum of
latents. Per head and step that is O(t d_c) work on the cache instead of rebuilding t keys and values of d_h.
Cache per token and layer: (d_c + d_r) elements, against 2 H d_h for multi-head attention.

The cache holds rows for more tokens than it has (MLACache.length): a step writes its token in place. A step is bound
by reading the cache, so on a GPU a bfloat16 cache is read by one Triton kernel (_latent_attention) that scores a tile
of latent rows for every head of its sequence and mixes the same tile into the weighted sum, the cached tokens cut
into a few ranges combined afterwards (flash-decoding): the cache read once, in its own dtype, on tensor cores. The
plain path beside it (_plain_latent_attention) serves every other cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
ROPE_BASE = 10000.0
# Ranges of cached tokens a decode step's kernel cuts each sequence into (at most; fewer for short caches).
DECODE_SPLITS = 4


@dataclass(frozen=True)
class MLAConfig:
    d_model: int
    n_heads: int
    head_dim: int
    latent_dim: int
    rope_dim: int

    def __post_init__(self) -> None:
        sizes = {"d_model": self.d_model, "n_heads": self.n_heads, "head_dim": self.head_dim,
                 "latent_dim": self.latent_dim, "rope_dim": self.rope_dim}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.rope_dim % 2:
            raise ValueError(f"rope_dim must be even, got {self.rope_dim}")


@dataclass
class MLACache:
    """The tokens so far at positions 0 .. length-1 of preallocated rows; the rows from `length` on are room that
    decode writes the next tokens into, in place, so that a step reads its cache without copying it."""

    latent: Tensor  # [B, capacity, latent_dim]
    rope_key: Tensor  # [B, capacity, rope_dim]
    length: int


def appended(cache: MLACache, latent: Tensor, rope_key: Tensor) -> MLACache:
    """The cache with one more token ([B, 1, ...] each) at position `length`: written in place into its rows when
    there is room, else into new rows of twice the capacity (the copy then paid once per as many steps). The given
    object's fields stay as they were."""
    batch, capacity, _ = cache.latent.shape
    rows = (cache.latent, cache.rope_key)
    if cache.length == capacity:
        rows = tuple(held.new_empty(batch, 2 * capacity, held.shape[2]) for held in rows)
        rows[0][:, :capacity], rows[1][:, :capacity] = cache.latent, cache.rope_key
    rows[0][:, cache.length], rows[1][:, cache.length] = latent[:, 0], rope_key[:, 0]
    return MLACache(*rows, length=cache.length + 1)


@triton.jit
def _split(a, dtype: tl.constexpr, SPLIT: tl.constexpr):
    """float32 `a` as two terms of the cache's dtype for tensor cores: with SPLIT (a bfloat16 cache) its rounding
    and the rounding's error, which together carry 16 of a's 24 bits where the rounding alone carries 8 (products of
    bfloat16 are exact in float32)."""
    high = a.to(dtype)
    if SPLIT:
        low = (a - high.to(tl.float32)).to(dtype)
    else:
        low = high
    return high, low


@triton.jit
def _split_dot(high, low, b, SPLIT: tl.constexpr):
    """(high + low) @ b, accumulated in float32."""
    out = tl.dot(high, b)
    if SPLIT:
        out += tl.dot(low, b)
    return out


@triton.jit
def _latent_attention_kernel(q_latent_ptr, q_rope_ptr, latent_ptr, rope_key_ptr, mixed_ptr, max_ptr, sum_ptr,
                             length, tokens_per_split, scale, heads, latent_dim, rope_dim,
                             stride_lb, stride_lt, stride_rb, stride_rt,
                             BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_T: tl.constexpr, SPLIT: tl.constexpr):
    """One program per (sequence, split of the cached tokens): every head of the sequence at once, so that each
    latent row is read once for the H scores and once more from the same tile for the H weighted sums (no second
    pass over the cache). Writes the split's unnormalised sum of latents [H, d_c], its running max and its sum of
    exponentials, which _latent_attention combines. Traffic: the split's rows, (d_c + d_r) elements a token, once."""
    batch, split = tl.program_id(0), tl.program_id(1)
    head_rows = tl.arange(0, BLOCK_H)
    latent_cols, rope_cols = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_R)
    q_offset = batch * heads + head_rows[:, None]
    q_latent = tl.load(q_latent_ptr + q_offset * latent_dim + latent_cols[None, :],
                       mask=(head_rows[:, None] < heads) & (latent_cols[None, :] < latent_dim), other=0.0)
    q_rope = tl.load(q_rope_ptr + q_offset * rope_dim + rope_cols[None, :],
                     mask=(head_rows[:, None] < heads) & (rope_cols[None, :] < rope_dim), other=0.0)
    dtype = latent_ptr.dtype.element_ty
    q_latent_high, q_latent_low = _split(q_latent, dtype, SPLIT)
    q_rope_high, q_rope_low = _split(q_rope, dtype, SPLIT)
    row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    mixed = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, length)
    for first in range(start, end, BLOCK_T):  # every tile holds at least one token below `end`
        tokens = first + tl.arange(0, BLOCK_T)
        held = tokens < end
        latent = tl.load(latent_ptr + batch * stride_lb + tokens[:, None] * stride_lt + latent_cols[None, :],
                         mask=held[:, None] & (latent_cols[None, :] < latent_dim), other=0.0)  # [T, d_c]
        rope_key = tl.load(rope_key_ptr + batch * stride_rb + tokens[:, None] * stride_rt + rope_cols[None, :],
                           mask=held[:, None] & (rope_cols[None, :] < rope_dim), other=0.0)  # [T, d_r]
        scores = (_split_dot(q_latent_high, q_latent_low, tl.trans(latent), SPLIT)
                  + _split_dot(q_rope_high, q_rope_low, tl.trans(rope_key), SPLIT))
        scores = tl.where(held[None, :], scores * scale, float("-inf"))  # [H, T]
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        rescale = tl.exp(row_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(weights, axis=1)
        weights_high, weights_low = _split(weights, dtype, SPLIT)
        mixed = mixed * rescale[:, None] + _split_dot(weights_high, weights_low, latent, SPLIT)
        row_max = new_max
    out = (batch * tl.num_programs(1) + split) * heads + head_rows
    tl.store(mixed_ptr + out[:, None] * latent_dim + latent_cols[None, :], mixed,
             mask=(head_rows[:, None] < heads) & (latent_cols[None, :] < latent_dim))
    tl.store(max_ptr + out, row_max, mask=head_rows < heads)
    tl.store(sum_ptr + out, row_sum, mask=head_rows < heads)


def _plain_latent_attention(q_latent: Tensor, q_rope: Tensor, cache: MLACache, scale: float) -> Tensor:
    """What _latent_attention computes, in torch operators in q's dtype (the accumulation dtype): the path of every
    cache but a bfloat16 one on a GPU."""
    # The held rows [B, t, d_c] and [B, t, d_r]: views of the cache, cast (copied) for a bfloat16 one.
    latent = cache.latent[:, :cache.length].to(q_latent.dtype)
    rope_key = cache.rope_key[:, :cache.length].to(q_latent.dtype)
    # Every head scores the same cached latents: its H absorbed queries are the rows of one [H, d_c] matrix per
    # sequence, so one batched product reads the cache once (a broadcast over heads would copy it H times).
    scores = torch.bmm(q_latent, latent.transpose(1, 2)) + torch.bmm(q_rope, rope_key.transpose(1, 2))
    weights = torch.softmax(scores * scale, dim=-1)  # [B, H, t]
    return torch.bmm(weights, latent)  # sum_s p_s c_s per head


def _dot_block(size: int) -> int:
    """A block covering `size` that tl.dot takes: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(size))


def _latent_attention(q_latent: Tensor, q_rope: Tensor, cache: MLACache, scale: float,
                      splits: int = DECODE_SPLITS) -> Tensor:
    """sum_s softmax_s(scale (q_latent . c_s + q_rope . k^R_s)) c_s over the cache's held tokens, [B, H, d_c] in
    float32, from q_latent [B, H, d_c] and q_rope [B, H, d_r] in float32: the cache read once, in its own dtype.
    The tokens are cut into `splits` ranges (flash-decoding), so that a small batch still fills the GPU; the
    splits' partial sums, B splits H d_c floats, are combined here."""
    batch, heads, latent_dim = q_latent.shape
    block_h = _dot_block(heads)
    # Measured on an H100 at B = 64, t = 8192, d_c = 512: 32-token tiles on 4 warps for 16 heads, 64-token tiles on
    # 8 warps for 32 (whose [32, d_c] float32 sums need the registers).
    block_t, warps = (32, 4) if block_h <= 16 else (64, 8)
    per_split = triton.cdiv(triton.cdiv(cache.length, splits), block_t) * block_t
    splits = triton.cdiv(cache.length, per_split)  # none empty
    mixed = q_latent.new_empty(batch, splits, heads, latent_dim)
    row_max = q_latent.new_empty(batch, splits, heads)
    row_sum = torch.empty_like(row_max)
    _latent_attention_kernel[(batch, splits)](
        q_latent.contiguous(), q_rope.contiguous(), cache.latent, cache.rope_key, mixed, row_max, row_sum,
        cache.length, per_split, scale, heads, latent_dim, q_rope.shape[-1],
        cache.latent.stride(0), cache.latent.stride(1), cache.rope_key.stride(0), cache.rope_key.stride(1),
        BLOCK_H=block_h, BLOCK_C=_dot_block(latent_dim), BLOCK_R=_dot_block(q_rope.shape[-1]), BLOCK_T=block_t,
        SPLIT=cache.latent.dtype == torch.bfloat16, num_warps=warps)
    overall = row_max.amax(dim=1, keepdim=True)
    weights = torch.exp(row_max - overall)  # [B, splits, H]
    return (weights[..., None] * mixed).sum(1) / (weights * row_sum).sum(1)[..., None]


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rope(x: Tensor, positions: Tensor) -> Tensor:
    """x [..., T, d_r] rotated at positions [T], in the accumulation dtype, rounded to x's dtype."""
    acc = _accumulation_dtype(x.dtype)
    half = x.shape[-1] // 2
    frequencies = ROPE_BASE ** (-torch.arange(half, device=x.device, dtype=acc) * 2 / x.shape[-1])
    angles = positions.to(acc)[:, None] * frequencies
    cos, sin = angles.cos(), angles.sin()
    first, second = x.to(acc)[..., :half], x.to(acc)[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)


def check_input(config: MLAConfig, h, name: str = "h") -> None:
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(h).__name__}")
    if h.dtype not in MODEL_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float64, got {h.dtype}")
    if h.ndim != 3 or h.shape[-1] != config.d_model or h.shape[1] == 0:
        raise ValueError(f"{name} must be [B, T, d_model = {config.d_model}] with T >= 1, got {tuple(h.shape)}")


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, config: MLAConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.kv_down = nn.Linear(c.d_model, c.latent_dim, bias=False)  # W_DKV
        self.key_up = nn.Linear(c.latent_dim, c.n_heads * c.head_dim, bias=False)  # W_UK
        self.value_up = nn.Linear(c.latent_dim, c.n_heads * c.head_dim, bias=False)  # W_UV
        self.rope_key = nn.Linear(c.d_model, c.rope_dim, bias=False)  # W_KR
        self.query = nn.Linear(c.d_model, c.n_heads * (c.head_dim + c.rope_dim), bias=False)  # W_Q
        self.out = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=False)  # W_O

    def _queries(self, h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(q [B, H, T, d_h], rotated q^R [B, H, T, d_r]) in the accumulation dtype."""
        c, (batch, length, _) = self.config, h.shape
        q = self.query(h).view(batch, length, c.n_heads, c.head_dim + c.rope_dim).transpose(1, 2)
        acc = _accumulation_dtype(h.dtype)
        return q[..., :c.head_dim].to(acc), rope(q[..., c.head_dim:], positions).to(acc)

    def _latents(self, h: Tensor, positions: Tensor) -> MLACache:
        """The cache of h's T tokens at these positions, without room."""
        return MLACache(self.kv_down(h), rope(self.rope_key(h), positions), length=h.shape[1])

    def forward(self, h: Tensor) -> Tensor:
        """The naive path: every head's keys and values materialised, causal over the T positions."""
        check_input(self.config, h)
        c, (batch, length, _) = self.config, h.shape
        acc = _accumulation_dtype(h.dtype)
        positions = torch.arange(length, device=h.device)
        q, q_rope = self._queries(h, positions)
        cache = self._latents(h, positions)
        k = self.key_up(cache.latent).view(batch, length, c.n_heads, c.head_dim).transpose(1, 2).to(acc)
        v = self.value_up(cache.latent).view(batch, length, c.n_heads, c.head_dim).transpose(1, 2).to(acc)
        scores = (q @ k.transpose(-1, -2) + q_rope @ cache.rope_key.to(acc)[:, None].transpose(-1, -2))
        scores = scores / math.sqrt(c.head_dim + c.rope_dim)
        causal = torch.ones(length, length, dtype=torch.bool, device=h.device).tril()
        weights = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
        heads = (weights @ v).transpose(1, 2).reshape(batch, length, c.n_heads * c.head_dim)
        return self.out(heads.to(h.dtype))

    def prefill(self, h: Tensor) -> tuple[Tensor, MLACache]:
        """forward(h), and the cache of its T tokens."""
        check_input(self.config, h)
        return self.forward(h), self._latents(h, torch.arange(h.shape[1], device=h.device))

    def decode(self, h: Tensor, cache: MLACache) -> tuple[Tensor, MLACache]:
        """One token h [B, 1, d_model] at position t = cache length, through the absorbed weights."""
        check_input(self.config, h)
        c, batch = self.config, h.shape[0]
        if h.shape[1] != 1 or cache.latent.shape[0] != batch:
            raise ValueError(f"decode takes one token per sequence of the cache's batch {cache.latent.shape[0]}, "
                             f"got h of shape {tuple(h.shape)}")
        capacity = cache.latent.shape[1]
        if cache.rope_key.shape[:2] != (batch, capacity) or not 1 <= cache.length <= capacity:
            raise ValueError(f"the cache's latent {tuple(cache.latent.shape)} and rope_key "
                             f"{tuple(cache.rope_key.shape)} must have one capacity, and its length {cache.length} "
                             "must be between 1 and it")
        acc = _accumulation_dtype(h.dtype)
        position = torch.arange(cache.length, cache.length + 1, device=h.device)  # no host copy
        new = self._latents(h, position)
        cache = appended(cache, new.latent, new.rope_key)
        q, q_rope = self._queries(h, position)  # [B, H, 1, d_h], [B, H, 1, d_r]
        key_up = self.key_up.weight.to(acc).view(c.n_heads, c.head_dim, c.latent_dim)
        # One product per head with the batch as its rows: a broadcast q @ key_up would copy key_up once per sequence.
        q_latent = torch.einsum("bhd,hdc->bhc", q.squeeze(2), key_up)  # [B, H, d_c]
        on_kernel = cache.latent.is_cuda and cache.latent.dtype == torch.bfloat16
        attend = _latent_attention if on_kernel else _plain_latent_attention
        mixed = attend(q_latent, q_rope.squeeze(2), cache, 1 / math.sqrt(c.head_dim + c.rope_dim))  # [B, H, d_c]
        value_up = self.value_up.weight.to(acc).view(c.n_heads, c.head_dim, c.latent_dim)
        heads = torch.einsum("bhc,hdc->bhd", mixed, value_up).reshape(batch, 1, c.n_heads * c.head_dim)
        return self.out(heads.to(h.dtype)), cache

    def cache_bytes_per_token(self) -> int:
        """(latent_dim + rope_dim) elements of the model's dtype."""
        return (self.config.latent_dim + self.config.rope_dim) * self.out.weight.element_size()
