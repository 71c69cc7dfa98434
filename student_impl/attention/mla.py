"""Multi-head latent attention (DeepSeek-V2): keys and values rebuilt from one cached latent vector per token,
with a decoupled rotary key shared by every head. Two paths that must agree: a naive one that materialises every
head's keys and values, and a decode path that keeps only the latents and never does.

Per token t (h_t of size d_model), per head i of H; d_h = head_dim, d_c = latent_dim, d_r = rope_dim:
    c_t   = W_DKV h_t                        [d_c]  (kv_down)    the latent: all the cache holds of k and v,
    k^R_t = RoPE_t(W_KR h_t)                 [d_r]  (rope_key)   beside this rotary key, shared by all heads;
    k_t,i = W_UK,i c_t,  v_t,i = W_UV,i c_t  [d_h]  (key_up, value_up; head i owns rows i d_h .. (i+1) d_h)
    [q_t,i ; q^R_t,i] = W_Q,i h_t            [d_h + d_r]  (query; head i owns rows i (d_h + d_r) ..), then
    q^R_t,i <- RoPE_t(q^R_t,i)
    score(t, s, i) = (q_t,i . k_s,i + q^R_t,i . k^R_s) / sqrt(d_h + d_r)   for s <= t (causal)
    o_t = W_O [o_t,1 ; ... ; o_t,H]  (out),   o_t,i = sum_{s <= t} softmax_s(score(t, s, i)) v_s,i
No normalisation of the latent, no compression of the queries, no biases.

RoPE (pinned): RoPE_t rotates each pair (x_j, x_{j + d_r/2}), j < d_r / 2, by the angle t * theta_j with
theta_j = 10000^(-2j / d_r) (the half-split convention, not adjacent pairs), positions t counted from 0 over the
whole sequence: y_j = x_j cos - x_{j + d_r/2} sin, y_{j + d_r/2} = x_{j + d_r/2} cos + x_j sin.
If you read DeepSeek's official code: it rotates adjacent pairs (x_2j, x_2j+1) (complex multiplication of
consecutive elements); here RoPE is half-split (rotate_half). The two differ on the same weights: adjacent pairs
fail test_forward on its explicit example (rope_dim 6, 40 tokens).

Dtypes (pinned). The model's dtype is its parameters' (float32 and bfloat16 graded; a float64 model computes in
float64 throughout, the grader's exact evaluation). Projections (nn.Linear) run in the model's dtype; scores,
softmax, the weighted sums and RoPE run in the accumulation dtype (`_accumulation_dtype`), and each head's
output is rounded to the model's dtype once, before `out`.

Parameter names are pinned (the grader loads a state_dict into your module): `__init__` is given. Any torch
operator may be used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class MLAConfig:
    """Sizes (given): d_model, n_heads (H), head_dim (d_h), latent_dim (d_c), rope_dim (d_r, even).

    Raises ValueError (in __post_init__) if a size is below 1 or rope_dim is odd.
    """

    d_model: int
    n_heads: int
    head_dim: int
    latent_dim: int
    rope_dim: int

    def __post_init__(self) -> None:
        """Given: the sizes' checks."""
        sizes = {"d_model": self.d_model, "n_heads": self.n_heads, "head_dim": self.head_dim,
                 "latent_dim": self.latent_dim, "rope_dim": self.rope_dim}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.rope_dim % 2:
            raise ValueError(f"rope_dim must be even, got {self.rope_dim}")


@dataclass
class MLACache:
    """What decoding keeps (given): rows for `capacity` tokens, latent [B, capacity, latent_dim] and rope_key
    [B, capacity, rope_dim] in the model's dtype, and `length`, the int count of tokens so far, whose latents c_s
    and rotary keys k^R_s are rows 0 .. length-1; the rows after them are room for the next tokens. Nothing else.

    The grader reads the first `length` rows, measures the two tensors, and continues decoding in a fresh module
    from a cache of its own (these rows copied into tensors with room): what decoding needs must be in here."""

    latent: Tensor
    rope_key: Tensor
    length: int


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Given: float64 for a float64 model, float32 for the others (float32, bfloat16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rope(x: Tensor, positions: Tensor) -> Tensor:
    """RoPE as pinned above: x [..., T, d_r] rotated at the int64 positions [T]; computed in the accumulation
    dtype and returned in x's dtype."""
    raise NotImplementedError


class MultiHeadLatentAttention(nn.Module):
    """One layer of multi-head latent attention (the formulas above)."""

    def __init__(self, config: MLAConfig) -> None:
        """Given: parameters kv_down (W_DKV), key_up (W_UK), value_up (W_UV), rope_key (W_KR), query (W_Q),
        out (W_O), all nn.Linear without bias."""
        super().__init__()
        self.config = config
        c = config
        self.kv_down = nn.Linear(c.d_model, c.latent_dim, bias=False)
        self.key_up = nn.Linear(c.latent_dim, c.n_heads * c.head_dim, bias=False)
        self.value_up = nn.Linear(c.latent_dim, c.n_heads * c.head_dim, bias=False)
        self.rope_key = nn.Linear(c.d_model, c.rope_dim, bias=False)
        self.query = nn.Linear(c.d_model, c.n_heads * (c.head_dim + c.rope_dim), bias=False)
        self.out = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=False)

    def forward(self, h: Tensor) -> Tensor:
        """The naive path over a whole sequence: h [B, T, d_model] -> [B, T, d_model], every head's keys and
        values materialised, causal, positions 0 .. T-1.

        Raises: TypeError if h is not a tensor or not float32, bfloat16 or float64; ValueError if h is not
        [B, T, d_model] with T >= 1.
        """
        raise NotImplementedError

    def prefill(self, h: Tensor) -> tuple[Tensor, MLACache]:
        """(forward(h), the cache of h's T tokens at positions 0 .. T-1: length T, any capacity from T up).
        Same errors as forward."""
        raise NotImplementedError

    def decode(self, h: Tensor, cache: MLACache) -> tuple[Tensor, MLACache]:
        """One token per sequence, h [B, 1, d_model], at position t = cache.length: (its output [B, 1, d_model],
        the cache with the token's latent and rotary key appended, length t + 1).

        Appending (pinned): when the cache has room (its capacity above t), write the token's rows in place at row t
        of the cache's own tensors and return an MLACache of those same tensors; copying the cache would read and
        write all of it once more per step, more than the step itself reads. Only a full cache is copied, into
        new tensors with room (twice the capacity, say, so that the copy is paid once per as many steps). The grader
        compares the memory of the tensors it gave with those returned while there was room.

        The absorbed path: each head's query moves into the latent space (W_UK,i^T q_t,i) and is scored against
        the cached latents; head i's output is W_UV,i applied to the weighted sum of latents. No tensor of every
        cached token's per-head keys or values ([B, H, t, d_h] or any tensor as large with a dimension t) may be
        built: the grader watches the operators decode runs. The heads share the cache: score the H absorbed
        queries of a sequence as the rows of one matrix against its [t, d_c] latents (torch.bmm); a matmul that
        broadcasts the cache over the heads copies it H times, which counts as building such a tensor. Nor may a
        step build that much in pieces (each head's keys one head at a time): summed over every tensor its operators
        return, what a step builds may grow by at most B (4 (latent_dim + rope_dim) + 16 n_heads) elements per
        cached token (copying or casting the cache a few times and a few [B, H, t] score tensors fit).

        Raises: as forward; ValueError if h holds more than one token or the batch differs from the cache's.
        (A cache's own consistency, its two capacities and its length, may be taken as given.)
        """
        raise NotImplementedError

    def cache_bytes_per_token(self) -> int:
        """Bytes the cache holds per token of its capacity and per sequence: (latent_dim + rope_dim) elements of
        the model's dtype (multi-head attention would keep 2 n_heads head_dim)."""
        raise NotImplementedError
