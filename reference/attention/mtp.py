"""Multi-token prediction (DeepSeek-V3): D sequential modules after the main model, each predicting one token further.

For tokens t_0 .. t_{T-1} and the main model's last hidden states h^0 [B, T, d] (h^0_i has read t_0 .. t_i and the
main model predicts t_{i+1} from it), depth k = 1 .. D computes, for positions i = 0 .. T-k-1,

    h'^k_i = W_k [RMSNorm_h(h^{k-1}_i) ; RMSNorm_e(Emb(t_{i+k}))]     (concatenated: hidden first, embedding second)
    h^k    = Block_k(h'^k)                                            (causal over the T - k positions)
    logits^k_i = Head(h^k_i)                                          (predicts t_{i+k+1})

with Emb and Head shared with the main model (and across depths). Position T-k-1 has no target (t_T does not exist):
its logits are returned and left out of the loss. The loss is

    L_MTP = (lambda / D) * sum_k CE_k,   CE_k = mean over the B (T - k - 1) positions with a target,

computed in the accumulation dtype. Position i of depth k has read t_0 .. t_{i+k} and nothing later: the chain of
depths keeps causality because each one adds the embedding of the token just before its target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class MTPConfig:
    vocab_size: int
    d_model: int
    n_heads: int
    depth: int
    loss_weight: float = 0.3
    eps: float = 1e-6

    def __post_init__(self) -> None:
        sizes = {"vocab_size": self.vocab_size, "d_model": self.d_model, "n_heads": self.n_heads, "depth": self.depth}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


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


class Block(nn.Module):
    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads = config.n_heads
        self.attention_norm = RMSNorm(d, config.eps)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d, config.eps)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, d = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).split(d, dim=-1)
        q, k, v = (t.reshape(batch, length, self.n_heads, d // self.n_heads).transpose(1, 2) for t in (q, k, v))
        acc = _accumulation_dtype(x.dtype)
        scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) / math.sqrt(d // self.n_heads)
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        weights = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
        attended = (weights @ v.to(acc)).to(x.dtype).transpose(1, 2).reshape(batch, length, d)
        x = x + self.out(attended)
        return x + self.down(F.silu(self.up(self.mlp_norm(x))))


class MTPDepth(nn.Module):
    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(config.d_model, config.eps)
        self.embedding_norm = RMSNorm(config.d_model, config.eps)
        self.projection = nn.Linear(2 * config.d_model, config.d_model, bias=False)
        self.block = Block(config)

    def forward(self, hidden: Tensor, embedded: Tensor) -> Tensor:
        """h^k from h^{k-1} and Emb(t_{i+k}), both [B, L, d] for the same L positions."""
        joined = torch.cat([self.hidden_norm(hidden), self.embedding_norm(embedded)], dim=-1)
        return self.block(self.projection(joined))


def check_arguments(config: MTPConfig, hidden, tokens) -> None:
    if not isinstance(hidden, torch.Tensor) or not isinstance(tokens, torch.Tensor):
        raise TypeError("hidden and tokens must be torch.Tensors")
    if tokens.dtype != torch.int64:
        raise TypeError(f"tokens must be int64, got {tokens.dtype}")
    if hidden.dtype not in MODEL_DTYPES:
        raise TypeError(f"hidden must be float32, bfloat16 or float64, got {hidden.dtype}")
    if tokens.ndim != 2 or hidden.ndim != 3:
        raise ValueError(f"tokens must be [B, T] and hidden [B, T, d_model], got {tuple(tokens.shape)} and "
                         f"{tuple(hidden.shape)}")
    if hidden.shape != (*tokens.shape, config.d_model):
        raise ValueError(f"hidden must be [B, T, d_model] = {(*tokens.shape, config.d_model)}, got "
                         f"{tuple(hidden.shape)}")
    if tokens.shape[1] < config.depth + 2:
        raise ValueError(f"T = {tokens.shape[1]} leaves depth {config.depth} without a target: T must be at least "
                         f"depth + 2 = {config.depth + 2}")


class MultiTokenPrediction(nn.Module):
    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.depths = nn.ModuleList(MTPDepth(config) for _ in range(config.depth))

    def forward(self, hidden: Tensor, tokens: Tensor) -> list[Tensor]:
        """[logits^1, ..., logits^D], logits^k of shape [B, T - k, vocab_size] in the model's dtype."""
        check_arguments(self.config, hidden, tokens)
        length = tokens.shape[1]
        logits = []
        for k, depth in enumerate(self.depths, start=1):
            # Positions 0 .. T-k-1 of the previous depth, beside the embeddings of t_k .. t_{T-1}.
            hidden = depth(hidden[:, :length - k], self.embedding(tokens[:, k:]))
            logits.append(self.head(hidden))
        return logits

    def loss(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        """(lambda / D) * sum over depths of the mean cross-entropy over the positions with a target."""
        acc = _accumulation_dtype(hidden.dtype)
        total = hidden.new_zeros((), dtype=acc)
        for k, logits in enumerate(self(hidden, tokens), start=1):
            # logits^k_i predicts t_{i+k+1}: the last position (i = T-k-1) has no target.
            total = total + F.cross_entropy(logits[:, :-1].to(acc).flatten(0, 1), tokens[:, k + 1:].flatten())
        return self.config.loss_weight / self.config.depth * total
