"""Multi-token prediction (DeepSeek-V3): D sequential modules after the main model, each one token further.

For tokens t_0 .. t_{T-1} and the main model's last hidden states h^0 [B, T, d] (h^0_i has read t_0 .. t_i; the
main model predicts t_{i+1} from it), depth k = 1 .. D computes, for positions i = 0 .. T-k-1:

    h'^k_i     = W_k [RMSNorm_h(h^{k-1}_i) ; RMSNorm_e(Emb(t_{i+k}))]   (hidden first, then embedding)
    h^k        = Block_k(h'^k)                                          (causal over the T - k positions)
    logits^k_i = Head(h^k_i)                                            (predicts t_{i+k+1})

h^{k-1} is the previous depth's output (h^0 for k = 1), restricted to its first T - k positions. Emb and Head
are the main model's, shared by every depth: one nn.Embedding and one nn.Linear, each used D times (no
copies). Position T-k-1 of depth k has no target (t_T does not exist): its logits are returned, and left out
of the loss

    L_MTP = (loss_weight / D) * sum_k CE_k,   CE_k = mean cross-entropy over the B (T - k - 1) positions of
                                                     depth k with a target (logits^k_i against t_{i+k+1}).

Position i of depth k has read t_0 .. t_{i+k} and nothing later (the grader changes one token and checks which
logits may move).

Two conventions differ from what you may have read:
- If you read the DeepSeek-V3 report: it writes CE_k = -(1/T) sum_i log P^k_i[target], divided by the
  sequence length; here CE_k is the mean over the B (T - k - 1) positions with a target (F.cross_entropy's
  default reduction over exactly them). Dividing by B T gives (T - k - 1) / T of the loss: test_loss fails
  on its explicit example (T = 9, D = 3).
- If you read the released DeepSeek-V3 model: each MTP module there ends in its own RMSNorm before the
  shared head (shared_head.norm); here no norm precedes the head: logits^k = Head(h^k), h^k as Block_k
  returned it (and there is no parameter for such a norm). A norm there fails test_logits on its explicit
  example (depth 1's logits).

Dtypes (pinned). The model's dtype is its parameters' (float32 and bfloat16 are graded; a float64 model computes
in float64 throughout, the grader's exact evaluation); hidden is given in it. The loss is computed in the
accumulation dtype (`_accumulation_dtype`): logits cast to it before the cross-entropy.

Parameter names are pinned (the grader loads a state_dict into your module): every `__init__` here is given,
and so are RMSNorm and Block. What is left to you: MTPDepth.forward, MultiTokenPrediction.forward and
MultiTokenPrediction.loss. Any torch operator may be used.
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
    """Sizes of the model (given).

    vocab_size: rows of the shared embedding and outputs of the shared head. d_model: the hidden size.
    n_heads: heads of every Block's attention (d_model a multiple of it). depth: D, the number of MTP modules.
    loss_weight: lambda of L_MTP. eps: every RMSNorm's epsilon.
    Raises ValueError (in __post_init__) if a size is below 1 or d_model is not a multiple of n_heads.
    """

    vocab_size: int
    d_model: int
    n_heads: int
    depth: int
    loss_weight: float = 0.3
    eps: float = 1e-6

    def __post_init__(self) -> None:
        """Given: the sizes' checks."""
        sizes = {"vocab_size": self.vocab_size, "d_model": self.d_model, "n_heads": self.n_heads, "depth": self.depth}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Given: float64 for a float64 model, float32 for the others (float32, bfloat16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2 over the last dimension) + eps) * weight (given), computed in the accumulation
    dtype and rounded to x's dtype once. Parameter: `weight` [d_model]."""

    def __init__(self, d_model: int, eps: float) -> None:
        """Given."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: Tensor) -> Tensor:
        """Given: [..., d_model] -> [..., d_model]."""
        acc = _accumulation_dtype(x.dtype)
        h = x.to(acc)
        h = h / torch.sqrt(h.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (h * self.weight.to(acc)).to(x.dtype)


class Block(nn.Module):
    """One pre-norm transformer block (given): causal multi-head attention without positional encoding, then
    a SiLU MLP of width 4 d_model, each with a residual connection."""

    def __init__(self, config: MTPConfig) -> None:
        """Given: parameters attention_norm, qkv, out, mlp_norm, up, down."""
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
        """Given: [B, L, d_model] -> [B, L, d_model]; position i reads positions 0 .. i only."""
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
    """One MTP module: two norms, the projection W_k (nn.Linear(2 d_model, d_model), no bias) and a block."""

    def __init__(self, config: MTPConfig) -> None:
        """Given: parameters hidden_norm, embedding_norm, projection, block."""
        super().__init__()
        self.hidden_norm = RMSNorm(config.d_model, config.eps)
        self.embedding_norm = RMSNorm(config.d_model, config.eps)
        self.projection = nn.Linear(2 * config.d_model, config.d_model, bias=False)
        self.block = Block(config)

    def forward(self, hidden: Tensor, embedded: Tensor) -> Tensor:
        """h^k = block(projection([hidden_norm(h^{k-1}) ; embedding_norm(Emb(t_{i+k}))])).

        Args: hidden [B, L, d_model], h^{k-1} at positions 0 .. L-1; embedded [B, L, d_model], Emb(t_{i+k}) at
        the same positions. Returns h^k [B, L, d_model], the model's dtype.
        """
        raise NotImplementedError


class MultiTokenPrediction(nn.Module):
    """The D MTP modules with the shared embedding and head (their parameters are the main model's)."""

    def __init__(self, config: MTPConfig) -> None:
        """Given: parameters embedding (nn.Embedding), head (nn.Linear(d_model, vocab_size), no bias),
        depths."""
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.depths = nn.ModuleList(MTPDepth(config) for _ in range(config.depth))

    def forward(self, hidden: Tensor, tokens: Tensor) -> list[Tensor]:
        """[logits^1, ..., logits^D]: logits^k of shape [B, T - k, vocab_size], the model's dtype.

        Args:
            hidden: h^0 [B, T, d_model] in the model's dtype and on its device.
            tokens: [B, T] int64, t_0 .. t_{T-1}.

        Raises (before any computation):
            TypeError: hidden or tokens is not a tensor; tokens is not int64; hidden is not float32, bfloat16
                or float64.
            ValueError: tokens is not 2-D or hidden not 3-D; hidden is not [B, T, d_model] for tokens' B and T;
                T < depth + 2 (a depth would have no position with a target).
        """
        raise NotImplementedError

    def loss(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        """L_MTP, a scalar in the accumulation dtype: (loss_weight / D) * sum over depths of the mean
        cross-entropy over the positions with a target. Same arguments and errors as forward."""
        raise NotImplementedError
