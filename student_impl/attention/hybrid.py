"""A hybrid decoder stack: Gated DeltaNet (linear attention) layers interleaved with causal softmax attention.

The stack (pinned; no embedding, no MLP, no positional encoding), for x of shape [B, T, d_model]:
    for i in range(n_layers):
        x = x + mixer_i(norm_i(x))           # norm_i(x) = rms_norm(x) * layers[i].norm.weight
    y = rms_norm(x) * final_norm.weight
Layer i (0-based) is causal softmax attention iff i % attention_every == attention_every - 1, else Gated
DeltaNet: with the defaults (8 layers, attention_every 4) the pattern is L L L A L L L A, three linear layers to
one attention layer. Blocks have no MLP, so that the problem stays about the two mixers and their caches.

Why a hybrid: a Gated DeltaNet layer carries a fixed-size state per head ([head_dim, head_dim]), so its decoding
memory and cost per token do not grow with the context; an attention layer keeps every past key and value (its
cache grows linearly) but recalls any of them exactly. A few attention layers among many linear ones keep most
of the recall at a fraction of the cache.

Dtypes (pinned). The model's dtype is its parameters' (float32 or bfloat16 are graded; a float64 model
computes in float64 throughout, which the grader may use as an exact evaluation); x is given in the model's
dtype and on its device (CPU or CUDA). The accumulation dtype is float64 for a float64 model and float32
otherwise (see `_accumulation_dtype`). Projections (nn.Linear) run in the model's dtype; their outputs are
cast to the accumulation dtype, every norm, gate, recurrence, score, softmax and weighted sum runs there,
and each mixer's output is rounded to the model's dtype once, just before its `o_proj`. Residual additions
are in the model's dtype.

Memory: cache_bytes(cache) = (number of GDN layers) * B * n_heads * head_dim^2 * 4
                            + (number of attention layers) * 2 * B * n_heads * t * head_dim
                              * (model element size)
after t tokens (float32 and bfloat16 models; 8 bytes per state element for a float64 model).

Parameter names are pinned (the grader loads a state_dict into your module): every `__init__` here is given,
fully written; keep it as it is. What is left to you: the two mixers' forward, the stack's forward, prefill
and decode, and cache_bytes. Any torch operator may be used
(torch.nn.functional.scaled_dot_product_attention included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class HybridConfig:
    """Sizes of the stack (pinned).

    d_model: width of the residual stream.
    n_heads: heads of every mixer; head h owns columns h*head_dim:(h+1)*head_dim of the q, k, v projections' outputs
        and of o_proj's input (n_heads * head_dim need not equal d_model).
    head_dim: K = V = head_dim, the key and value size of the Gated DeltaNet heads, and the attention heads' size.
    n_layers: number of blocks.
    attention_every: layer i is attention iff i % attention_every == attention_every - 1 (1: every layer is
        attention; more than n_layers: none is).
    eps: the RMSNorm epsilon.

    Raises ValueError (in __post_init__) if d_model, n_heads, head_dim or n_layers is below 1, or
    attention_every < 1.
    """

    d_model: int = 64
    n_heads: int = 2
    head_dim: int = 32
    n_layers: int = 8
    attention_every: int = 4
    eps: float = 1e-6

    def __post_init__(self) -> None:
        """Given: the sizes' checks."""
        sizes = {"d_model": self.d_model, "n_heads": self.n_heads, "head_dim": self.head_dim, "n_layers": self.n_layers,
                 "attention_every": self.attention_every}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"HybridConfig.{name} must be at least 1, got {value}")

    def is_attention(self, layer: int) -> bool:
        """Given: whether layer `layer` (0-based) is a softmax attention layer; otherwise it is Gated DeltaNet."""
        return layer % self.attention_every == self.attention_every - 1


@dataclass
class HybridCache:
    """What decoding needs from the tokens seen so far: one entry per layer, in layer order.

    layers[i], for a Gated DeltaNet layer: its state S, a tensor [B, n_heads, head_dim, head_dim] (key index first,
        value index second) in the accumulation dtype (float32 for float32 and bfloat16 models).
    layers[i], for an attention layer: a tuple (k_cache, v_cache), each [B, n_heads, t, head_dim] in the model's
        dtype, the keys and values of the t tokens seen so far (as the projections produced them: no positional
        encoding, no scaling), oldest first. One decode step makes t one longer (torch.cat is fine).
    Nothing else in the cache holds tensors. The batch size B is the first dimension of every entry.
    Graded: these contents are compared with the reference's after prefill and after the last decode step (a cache
    of anything else, say the normalised inputs re-projected at every step, fails test_decode_matches_forward even
    where it has the bytes of the keys and values).
    """

    layers: list = field(default_factory=list)


def cache_bytes(cache: HybridCache) -> int:
    """The bytes of every tensor in cache.layers: the sum over them of numel() * element_size(), a Python int.

    So after t tokens: (number of GDN layers) * B * n_heads * head_dim^2 * 4 + (number of attention layers)
    * 2 * B * n_heads * t * head_dim * (model element size), for float32 and bfloat16 models. The grader also
    measures the cache itself, of a float32 and of a bfloat16 model: every GDN entry has the same bytes after 64
    tokens as after 4096; attention entries grow linearly in t, in the model's dtype.
    """
    raise NotImplementedError


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Given: float64 for a float64 model, float32 for the others (float32, bfloat16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2 over the last dimension) + eps) * weight (given: this is not the lesson).

    Computed in the accumulation dtype (x and weight cast to it first) and rounded to x's dtype once, at the end.
    Parameter: `weight` [d_model], initialised to ones.
    """

    def __init__(self, d_model: int, eps: float) -> None:
        """Given: the parameter `weight`, ones."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: Tensor) -> Tensor:
        """Given: [..., d_model] -> [..., d_model], x's dtype."""
        acc = _accumulation_dtype(x.dtype)
        h = x.to(acc)
        h = h / torch.sqrt(h.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (h * self.weight.to(acc)).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet mixer: a gated delta-rule recurrence with a [head_dim, head_dim] state per head.

    For each token t of x ([B, T, d_model]) and each head h (take columns h*head_dim:(h+1)*head_dim of the q, k, v
    projections, and column h of g_proj's and beta_proj's outputs), with l2norm(z) = z / sqrt(sum(z^2) + 1e-6) over
    head_dim (the 1e-6 inside the square root), all in the accumulation dtype:
        q_t    = l2norm(q_proj(x)_t) / sqrt(head_dim)     [head_dim]
        k_t    = l2norm(k_proj(x)_t)                      [head_dim]
        v_t    = v_proj(x)_t                              [head_dim]
        g_t    = -softplus(g_proj(x)_t)                   scalar, the log of the decay (<= 0): the decay is exp(g_t)
        beta_t = sigmoid(beta_proj(x)_t)                  scalar in (0, 1), the delta rule's step size
        S_t    = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T   [head_dim (keys), head_dim (values)]
        o_t    = S_t^T q_t                                [head_dim], read after the update, so token t sees itself
    S_0 is the given state, or zeros. The heads' outputs o_t are concatenated in head order, rounded to the model's
    dtype, and projected by o_proj. Equivalently, with S' = exp(g_t) S_{t-1} (decay first), the update is
        S_t = S' + k_t (beta_t (v_t - S'^T k_t))^T
    (write beta_t times the error of the decayed state's prediction for k_t into the k_t direction).

    Speed: a Python loop over the tokens is exact but slow for long sequences (the grader prefills 4096 tokens). The
    chunked form is exact too: within a chunk of C tokens (e.g. 64), the updates u_t = beta_t (v_t - exp(g_t)
    S_{t-1}^T k_t) solve a unit lower-triangular C x C system whose right-hand side depends on the chunk's initial
    state only linearly, so every chunk's system can be solved at once (torch.linalg.solve_triangular), leaving a
    loop over chunks that carries S.

    Parameters (given): `q_proj`, `k_proj`, `v_proj` nn.Linear(d_model, n_heads * head_dim, bias=False); `g_proj`,
    `beta_proj` nn.Linear(d_model, n_heads, bias=True); `o_proj` nn.Linear(n_heads * head_dim, d_model, bias=False).
    """

    def __init__(self, config: HybridConfig) -> None:
        """Given: the pinned projections, and slow initial decays (the grader loads its own weights)."""
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
        """Run the recurrence over x from `state`: returns (y, final state).

        Args:
            x: [B, T, d_model] in the model's dtype, T >= 1 (the normalised residual stream).
            state: [B, n_heads, head_dim, head_dim] in the accumulation dtype, the state after the tokens before
                x; None means zeros (x starts the sequence). It is not modified.

        Returns:
            y: [B, T, d_model] in the model's dtype, o_proj of the concatenated o_t.
            state: S_T, a new [B, n_heads, head_dim, head_dim] tensor in the accumulation dtype.
        Differentiable with respect to x, the parameters and `state`.
        """
        raise NotImplementedError


class CausalSelfAttention(nn.Module):
    """The attention mixer: multi-head causal softmax attention, no positional encoding.

    q, k, v = q_proj(x), k_proj(x), v_proj(x), each split into n_heads heads of head_dim (head h: columns
    h*head_dim:(h+1)*head_dim), in the model's dtype. For each head, token i (counting the cached tokens first)
    attends to every key j <= i, the cached ones included:
        o_i = sum_{j <= i} softmax_j(q_i . k_j / sqrt(head_dim)) v_j
    scores, softmax and weighted sum in the accumulation dtype; the heads' outputs are concatenated in head order,
    rounded to the model's dtype and projected by o_proj. No positional encoding: the Gated DeltaNet layers carry
    the order of the tokens.

    Parameters (given): `q_proj`, `k_proj`, `v_proj` nn.Linear(d_model, n_heads * head_dim, bias=False); `o_proj`
    nn.Linear(n_heads * head_dim, d_model, bias=False).
    """

    def __init__(self, config: HybridConfig) -> None:
        """Given: the pinned projections."""
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        inner = config.n_heads * config.head_dim
        self.q_proj = nn.Linear(config.d_model, inner, bias=False)
        self.k_proj = nn.Linear(config.d_model, inner, bias=False)
        self.v_proj = nn.Linear(config.d_model, inner, bias=False)
        self.o_proj = nn.Linear(inner, config.d_model, bias=False)

    def forward(self, x: Tensor, kv: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Attend from the T tokens of x to the cached tokens and to themselves (causally): returns (y, new cache).

        Args:
            x: [B, T, d_model] in the model's dtype, T >= 1.
            kv: (k_cache, v_cache), each [B, n_heads, t, head_dim] in the model's dtype, the keys and values of the t
                tokens before x; None means t = 0. Not modified.

        Returns:
            y: [B, T, d_model] in the model's dtype.
            (k_cache, v_cache): each [B, n_heads, t + T, head_dim] in the model's dtype: the old cache followed by the
                keys and values of x.
        Differentiable with respect to x, the parameters and kv.
        """
        raise NotImplementedError


class HybridBlock(nn.Module):
    """One pre-norm residual block: x + mixer(norm(x)), the mixer's cache entry passed through (given).

    Submodules: `norm` an RMSNorm(d_model) and `mixer` a CausalSelfAttention if config.is_attention(layer), else a
    GatedDeltaNet.
    """

    def __init__(self, config: HybridConfig, layer: int) -> None:
        """Given: `norm` and `mixer`, by the layer's kind."""
        super().__init__()
        self.norm = RMSNorm(config.d_model, config.eps)
        self.mixer = CausalSelfAttention(config) if config.is_attention(layer) else GatedDeltaNet(config)

    def forward(self, x: Tensor, entry=None):
        """Given: returns (x + y, new cache entry), with (y, new cache entry) = mixer(norm(x), entry)."""
        y, entry = self.mixer(self.norm(x), entry)
        return x + y, entry


class HybridStack(nn.Module):
    """The hybrid decoder stack: n_layers HybridBlocks, then a final RMSNorm (see the module docstring).

    Submodules (given): `layers` an nn.ModuleList of HybridBlock(config, i) for i in range(n_layers), and
    `final_norm` an RMSNorm(d_model). So the state_dict keys are, e.g., layers.0.norm.weight,
    layers.0.mixer.q_proj.weight, layers.0.mixer.g_proj.bias, layers.3.mixer.o_proj.weight, final_norm.weight.

    Input checks (each method, before any computation): ValueError if x is not 3-D, its last dimension is not
    d_model, or B or T is 0; decode also raises ValueError if x_t has more than one token, if cache.layers does not
    have one entry per layer, or if the cache's batch size differs from x_t's.
    """

    def __init__(self, config: HybridConfig) -> None:
        """Given: `layers` and `final_norm`."""
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(HybridBlock(config, i) for i in range(config.n_layers))
        self.final_norm = RMSNorm(config.d_model, config.eps)

    def forward(self, x: Tensor) -> Tensor:
        """The whole sequence at once: x [B, T, d_model] -> y [B, T, d_model], the model's dtype.

        Token t's output depends on tokens 0..t only. Differentiable with respect to x and every parameter.
        """
        raise NotImplementedError

    def prefill(self, x: Tensor) -> tuple[Tensor, HybridCache]:
        """forward(x) and the cache after its T tokens: returns (y, cache).

        y equals forward(x) (to rounding). cache.layers[i] is layer i's final GDN state, or its (k_cache, v_cache)
        of t = T tokens (see HybridCache).
        """
        raise NotImplementedError

    def decode(self, x_t: Tensor, cache: HybridCache) -> tuple[Tensor, HybridCache]:
        """One more token: x_t [B, 1, d_model] and the cache after t tokens -> (y_t [B, 1, d_model], the cache after
        t + 1 tokens).

        The cache returned may be the same object, updated (its entries replaced or grown), or a new one. Per token,
        a GDN layer costs O(n_heads * head_dim^2) whatever t, an attention layer O(n_heads * t * head_dim).
        Consistency (graded): prefill(x[:, :P]) followed by decode of x[:, P], x[:, P+1], ... one token at a time
        reproduces forward(x)[:, P:] (to the dtype's rounding), for every 1 <= P <= T.
        """
        raise NotImplementedError
