"""A hybrid decoder stack: Gated DeltaNet layers interleaved 3:1 with causal softmax attention, with a decode cache.

Design. Every mixer has one signature, `mixer(x, entry) -> (y, entry)`, where `entry` is what the layer keeps between
calls (a GDN state, or an attention layer's keys and values) and None means "nothing seen yet". So forward, prefill
and decode are one loop over the blocks, and differ only in which entries go in and whether the new ones are kept.

Gated DeltaNet. Written as S_t = exp(g_t) S_{t-1} + k_t u_t^T with u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t), the
state after t tokens of a chunk is a decayed sum of rank-one terms, and the u_t of one chunk satisfy
    (I + A) U = diag(beta) V - diag(beta * gamma) K S_0,    A[t, j] = beta_t (gamma_t / gamma_j) k_t . k_j  (j < t)
where gamma_t = exp(g_1 + ... + g_t) within the chunk and S_0 is its initial state. The triangular solve does not
depend on S_0, so every chunk's is done at once; only U = U~ - W S_0 and the state update stay in a loop over
chunks (T / 64 steps of small matmuls), and the outputs are computed for all chunks after it. Decoding one token
uses the recurrence itself, O(n_heads * head_dim^2) whatever the context.

Memory. A GDN layer's cache is its state, n_heads * head_dim^2 numbers per sequence, the same after 64 tokens as
after a million; an attention layer's is 2 * n_heads * t * head_dim, growing with every token. The chunked form holds
C x C matrices per chunk (T * C per head, not T^2) and one saved state per chunk; attention goes through
scaled_dot_product_attention, which needs no T x T score matrix on the backends that support the mask used.

Dtypes: projections in the model's dtype; everything else in float32 (float64 for a float64 model, which makes
the reference usable as an exact evaluation); mixer outputs rounded to the model's dtype before o_proj.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Tokens per chunk of the chunked GDN form: C x C solves are cheap, and T / C loop steps stay few.
CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


@dataclass(frozen=True)
class HybridConfig:
    d_model: int = 64
    n_heads: int = 2
    head_dim: int = 32
    n_layers: int = 8
    attention_every: int = 4
    eps: float = 1e-6

    def __post_init__(self) -> None:
        sizes = {"d_model": self.d_model, "n_heads": self.n_heads, "head_dim": self.head_dim, "n_layers": self.n_layers,
                 "attention_every": self.attention_every}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"HybridConfig.{name} must be at least 1, got {value}")

    def is_attention(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) is a softmax attention layer; otherwise it is Gated DeltaNet."""
        return layer % self.attention_every == self.attention_every - 1


@dataclass
class HybridCache:
    # Per layer: a GDN state [B, H, K, V], or an attention layer's (k_cache, v_cache), each [B, H, t, head_dim].
    layers: list = field(default_factory=list)


def _entry_tensors(entry) -> tuple[Tensor, ...]:
    return entry if isinstance(entry, tuple) else (entry,)


def cache_bytes(cache: HybridCache) -> int:
    return sum(t.numel() * t.element_size() for entry in cache.layers for t in _entry_tensors(entry))


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for a float64 model, float32 for the others (float32, bfloat16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _l2norm(z: Tensor) -> Tensor:
    return z / torch.sqrt(z.pow(2).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _split_heads(z: Tensor, n_heads: int) -> Tensor:
    """[B, T, n_heads * d] -> [B, n_heads, T, d]."""
    batch, seq, _ = z.shape
    return z.view(batch, seq, n_heads, -1).transpose(1, 2)


def _merge_heads(z: Tensor) -> Tensor:
    """[B, n_heads, T, d] -> [B, T, n_heads * d]."""
    batch, n_heads, seq, dim = z.shape
    return z.transpose(1, 2).reshape(batch, seq, n_heads * dim)


def _delta_rule_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One token: q, k, v [B, H, 1, d], g, beta [B, H, 1], state [B, H, K, V] -> (o [B, H, 1, V], new state)."""
    decayed = state * torch.exp(g)[..., None]
    error = v - k @ decayed  # [B, H, 1, V]: the value minus what the decayed state recalls for k
    state = decayed + k.transpose(-1, -2) @ (beta[..., None] * error)
    return q @ state, state


def _pad_to_chunks(z: Tensor, length: int) -> Tensor:
    """Zero-pad dim 2 (time) of z to `length`. Padded tokens have k = 0, beta = 0 and g = 0: the state passes them
    unchanged (no write, decay 1), so padding the last chunk changes nothing."""
    pad = length - z.shape[2]
    if pad == 0:
        return z
    return F.pad(z, (0, 0, 0, pad) if z.dim() == 4 else (0, pad))


def _chunked_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                        state: Tensor) -> tuple[Tensor, Tensor]:
    """The whole sequence: q, k, v [B, H, T, d], g, beta [B, H, T], state [B, H, K, V] -> (o [B, H, T, V], S_T)."""
    batch, n_heads, seq, key_dim = k.shape
    n_chunks = -(-seq // CHUNK_SIZE)
    q, k, v, g, beta = (_pad_to_chunks(z, n_chunks * CHUNK_SIZE) for z in (q, k, v, g, beta))
    q, k, v = (z.reshape(batch, n_heads, n_chunks, CHUNK_SIZE, -1) for z in (q, k, v))
    g, beta = (z.reshape(batch, n_heads, n_chunks, CHUNK_SIZE) for z in (g, beta))

    log_gamma = g.cumsum(dim=-1)  # log of the decay from the chunk's start through token t
    ones = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool, device=q.device)
    # gamma_t / gamma_j for j <= t, else 0; masked before exp, where the difference is positive and may overflow.
    decay = torch.exp((log_gamma[..., :, None] - log_gamma[..., None, :]).masked_fill(~ones.tril(), -math.inf))

    # A's diagonal is beta_t * |k_t|^2, but the solve takes the unit diagonal as given and reads only below it.
    a = beta[..., None] * (k @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([(beta * torch.exp(log_gamma))[..., None] * k, beta[..., None] * v], dim=-1)
    w, u_free = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True).split(
        [key_dim, v.shape[-1]], dim=-1)

    chunk_decay = torch.exp(log_gamma[..., -1])[..., None, None]  # gamma_C, [B, H, n_chunks, 1, 1]
    k_to_end = k * torch.exp(log_gamma[..., -1:] - log_gamma)[..., None]  # k_j * gamma_C / gamma_j
    initial_states, updates = [], []
    for c in range(n_chunks):
        initial_states.append(state)
        u = u_free[:, :, c] - w[:, :, c] @ state
        updates.append(u)
        state = chunk_decay[:, :, c] * state + k_to_end[:, :, c].transpose(-1, -2) @ u

    # o_t = gamma_t S_0^T q_t + sum_{j <= t} (gamma_t / gamma_j) (q_t . k_j) u_j, for every chunk at once.
    initial_states, updates = torch.stack(initial_states, dim=2), torch.stack(updates, dim=2)
    o = (q * torch.exp(log_gamma)[..., None]) @ initial_states + ((q @ k.transpose(-1, -2)) * decay) @ updates
    return o.reshape(batch, n_heads, n_chunks * CHUNK_SIZE, -1)[:, :, :seq], state


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: Tensor) -> Tensor:
        acc = _accumulation_dtype(x.dtype)
        h = x.to(acc)
        h = h / torch.sqrt(h.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (h * self.weight.to(acc)).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        inner = config.n_heads * config.head_dim
        self.q_proj = nn.Linear(config.d_model, inner, bias=False)
        self.k_proj = nn.Linear(config.d_model, inner, bias=False)
        self.v_proj = nn.Linear(config.d_model, inner, bias=False)
        self.g_proj = nn.Linear(config.d_model, config.n_heads, bias=True)
        self.beta_proj = nn.Linear(config.d_model, config.n_heads, bias=True)
        self.o_proj = nn.Linear(inner, config.d_model, bias=False)
        # Start with slow decays: softplus(bias) log-uniform in [1e-3, 1e-1], so exp(g) is about 0.9 to 0.999.
        with torch.no_grad():
            rate = torch.exp(torch.empty(config.n_heads).uniform_(math.log(1e-3), math.log(1e-1)))
            self.g_proj.bias.copy_(rate + torch.log(-torch.expm1(-rate)))

    def forward(self, x: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
        acc = _accumulation_dtype(x.dtype)
        q = _l2norm(_split_heads(self.q_proj(x), self.n_heads).to(acc)) / math.sqrt(self.head_dim)
        k = _l2norm(_split_heads(self.k_proj(x), self.n_heads).to(acc))
        v = _split_heads(self.v_proj(x), self.n_heads).to(acc)
        g = -F.softplus(self.g_proj(x).to(acc)).transpose(1, 2)  # [B, H, T]
        beta = torch.sigmoid(self.beta_proj(x).to(acc)).transpose(1, 2)
        if state is None:
            batch = x.shape[0]
            state = torch.zeros(batch, self.n_heads, self.head_dim, self.head_dim, dtype=acc, device=x.device)
        step = _delta_rule_step if x.shape[1] == 1 else _chunked_delta_rule
        o, state = step(q, k, v, g, beta, state)
        return self.o_proj(_merge_heads(o).to(x.dtype)), state


def _causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """q [B, H, T, d] are the last T of the keys' positions [B, H, t + T, d]; query i sees keys j <= t + i."""
    seq, past = q.shape[2], k.shape[2] - q.shape[2]
    acc = _accumulation_dtype(q.dtype)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if past == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if seq == 1:  # one new token sees every key
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    # SDPA's is_causal aligns the mask to the top left; with a cache the queries sit at the bottom right.
    visible = torch.arange(past + seq, device=q.device) <= torch.arange(past, past + seq, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        inner = config.n_heads * config.head_dim
        self.q_proj = nn.Linear(config.d_model, inner, bias=False)
        self.k_proj = nn.Linear(config.d_model, inner, bias=False)
        self.v_proj = nn.Linear(config.d_model, inner, bias=False)
        self.o_proj = nn.Linear(inner, config.d_model, bias=False)

    def forward(self, x: Tensor, kv: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        q = _split_heads(self.q_proj(x), self.n_heads)
        # Contiguous [B, H, t, d], so that the cache is laid out as it is measured and decoding reads it in order.
        k = _split_heads(self.k_proj(x), self.n_heads).contiguous()
        v = _split_heads(self.v_proj(x), self.n_heads).contiguous()
        if kv is not None:
            k, v = torch.cat([kv[0], k], dim=2), torch.cat([kv[1], v], dim=2)
        o = _causal_attention(q, k, v)
        return self.o_proj(_merge_heads(o).to(x.dtype)), (k, v)


class HybridBlock(nn.Module):
    def __init__(self, config: HybridConfig, layer: int) -> None:
        super().__init__()
        self.norm = RMSNorm(config.d_model, config.eps)
        self.mixer = CausalSelfAttention(config) if config.is_attention(layer) else GatedDeltaNet(config)

    def forward(self, x: Tensor, entry=None):
        y, entry = self.mixer(self.norm(x), entry)
        return x + y, entry


class HybridStack(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(HybridBlock(config, i) for i in range(config.n_layers))
        self.final_norm = RMSNorm(config.d_model, config.eps)

    def _check_input(self, x: Tensor) -> None:
        if x.dim() != 3 or x.shape[-1] != self.config.d_model:
            raise ValueError(f"x must be [B, T, d_model={self.config.d_model}], got shape {tuple(x.shape)}")
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError(f"x must have at least one sequence and one token, got shape {tuple(x.shape)}")

    def _run(self, x: Tensor, entries: list) -> tuple[Tensor, list]:
        new_entries = []
        for block, entry in zip(self.layers, entries, strict=True):
            x, entry = block(x, entry)
            new_entries.append(entry)
        return self.final_norm(x), new_entries

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        return self._run(x, [None] * len(self.layers))[0]

    def prefill(self, x: Tensor) -> tuple[Tensor, HybridCache]:
        self._check_input(x)
        y, entries = self._run(x, [None] * len(self.layers))
        return y, HybridCache(entries)

    def decode(self, x_t: Tensor, cache: HybridCache) -> tuple[Tensor, HybridCache]:
        self._check_input(x_t)
        if x_t.shape[1] != 1:
            raise ValueError(f"decode takes one token at a time, got {x_t.shape[1]}")
        if len(cache.layers) != len(self.layers):
            raise ValueError(f"the cache has {len(cache.layers)} entries for {len(self.layers)} layers")
        batches = {t.shape[0] for entry in cache.layers for t in _entry_tensors(entry)}
        if batches != {x_t.shape[0]}:
            raise ValueError(f"the cache is for batch sizes {sorted(batches)}, x_t has batch size {x_t.shape[0]}")
        y, cache.layers = self._run(x_t, cache.layers)
        return y, cache
