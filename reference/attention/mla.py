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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
ROPE_BASE = 10000.0


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
        # Every head scores the same cached latents: its H absorbed queries W_UK,i^T q_i are the rows of one [H, d_c]
        # matrix per sequence, so one batched product reads the cache once (a broadcast over heads would copy it H
        # times).
        # One product per head with the batch as its rows: a broadcast q @ key_up would copy key_up once per sequence.
        q_latent = torch.einsum("bhd,hdc->bhc", q.squeeze(2), key_up)  # [B, H, d_c]
        # The held rows [B, t, d_c] and [B, t, d_r], views of the cache (a copy only where a bfloat16 cache is cast).
        latent = cache.latent[:, :cache.length].to(acc)
        rope_key = cache.rope_key[:, :cache.length].to(acc)
        scores = torch.bmm(q_latent, latent.transpose(1, 2)) + torch.bmm(q_rope.squeeze(2), rope_key.transpose(1, 2))
        weights = torch.softmax(scores / math.sqrt(c.head_dim + c.rope_dim), dim=-1)  # [B, H, t]
        mixed = torch.bmm(weights, latent)  # sum_s p_s c_s per head: [B, H, d_c]
        value_up = self.value_up.weight.to(acc).view(c.n_heads, c.head_dim, c.latent_dim)
        heads = torch.einsum("bhc,hdc->bhd", mixed, value_up).reshape(batch, 1, c.n_heads * c.head_dim)
        return self.out(heads.to(h.dtype)), cache

    def cache_bytes_per_token(self) -> int:
        """(latent_dim + rope_dim) elements of the model's dtype."""
        return (self.config.latent_dim + self.config.rope_dim) * self.out.weight.element_size()
