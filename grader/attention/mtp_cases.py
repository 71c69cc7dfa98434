"""What attention.mtp's tests share: a model's sizes and weights, and the programs that run it inside the worker (the
student's module) or in the grader's process (the reference's, at the case's dtype and at float64, the oracle).

The weights are the grader's, drawn by the pinned parameter names and loaded into both models, so every comparison is
of one model; the tokens and the main model's hidden states h^0 are drawn with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from grader.checks.strategies import size_scale
from grader.session.context import current


@dataclass(frozen=True)
class MTPCase:
    batch: int
    seq: int
    vocab_size: int
    d_model: int
    n_heads: int
    depth: int
    loss_weight: float = 0.3
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def config(self) -> dict:
        return {"vocab_size": self.vocab_size, "d_model": self.d_model, "n_heads": self.n_heads,
                "depth": self.depth, "loss_weight": self.loss_weight}

    def parameters(self) -> dict[str, torch.Tensor]:
        """The weights by their pinned names, in float64 holding values exact in the case's dtype."""
        generator = torch.Generator().manual_seed(self.seed)
        d = self.d_model

        def normal(*shape, fan_in=None, shift=0.0):
            scale = 0.1 if fan_in is None else fan_in**-0.5
            return torch.randn(shape, generator=generator, dtype=torch.float64) * scale + shift

        weights = {"embedding.weight": normal(self.vocab_size, d, fan_in=1),
                   "head.weight": normal(self.vocab_size, d, fan_in=d)}
        for k in range(self.depth):
            prefix = f"depths.{k}."
            for norm in ("hidden_norm", "embedding_norm", "block.attention_norm", "block.mlp_norm"):
                weights[prefix + norm + ".weight"] = normal(d, shift=1.0)
            weights[prefix + "projection.weight"] = normal(d, 2 * d, fan_in=2 * d)
            weights[prefix + "block.qkv.weight"] = normal(3 * d, d, fan_in=d)
            weights[prefix + "block.out.weight"] = normal(d, d, fan_in=d)
            weights[prefix + "block.up.weight"] = normal(4 * d, d, fan_in=d)
            weights[prefix + "block.down.weight"] = normal(d, 4 * d, fan_in=4 * d)
        return {name: tensor.to(self.dtype).double() for name, tensor in weights.items()}

    def exact_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """h^0 (float64 holding values exact in the case's dtype) and the tokens."""
        generator = torch.Generator().manual_seed(self.seed + 1)
        hidden = torch.randn(self.batch, self.seq, self.d_model, generator=generator, dtype=torch.float64)
        tokens = torch.randint(0, self.vocab_size, (self.batch, self.seq), generator=generator)
        return hidden.to(self.dtype).double(), tokens

    def describe(self) -> str:
        return (f"batch={self.batch}, seq={self.seq}, vocab_size={self.vocab_size}, d_model={self.d_model}, "
                f"n_heads={self.n_heads}, depth={self.depth}, loss_weight={self.loss_weight}, "
                f"dtype={str(self.dtype).removeprefix('torch.')}, seed={self.seed}")


@st.composite
def mtp_cases(draw, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> MTPCase:
    """Depths 1 to 3 over sequences from depth + 2 (one target at the last depth) to 20 under `ci` on a CPU."""
    depth = draw(st.integers(1, 3))
    n_heads = draw(st.integers(1, 2))
    return MTPCase(
        batch=draw(st.integers(1, 3)),
        seq=draw(st.integers(depth + 2, max(depth + 2, 20 * size_scale()))),
        vocab_size=draw(st.sampled_from([7, 16, 33])),
        d_model=n_heads * draw(st.sampled_from([4, 8, 16])),
        n_heads=n_heads,
        depth=depth,
        loss_weight=draw(st.sampled_from([0.3, 1.0])),
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def case_tensors(case: MTPCase, dtype: torch.dtype | None = None) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(weights, hidden, tokens) at `dtype` (the case's by default) on the grader's device."""
    dtype = dtype or case.dtype
    device = current().device
    hidden, tokens = case.exact_inputs()
    weights = {name: tensor.to(device, dtype) for name, tensor in case.parameters().items()}
    return weights, hidden.to(device, dtype), tokens.to(device)


# --- programs: run in the worker on the student's module, and here on the reference's ------------------------------


def build(module, config: dict, weights: dict):
    any_weight = next(iter(weights.values()))
    model = module.MultiTokenPrediction(module.MTPConfig(**config)).to(any_weight.device, any_weight.dtype)
    model.load_state_dict(weights)
    return model


def _plain(values) -> list:
    return [v.detach() if isinstance(v, torch.Tensor) else v for v in values] if isinstance(values, (list, tuple)) \
        else values


@torch.no_grad()
def run_logits(module, config: dict, weights: dict, hidden: torch.Tensor, tokens: torch.Tensor) -> list:
    """forward(hidden, tokens): the logits of every depth."""
    return _plain(build(module, config, weights)(hidden, tokens))


def run_loss(module, config: dict, weights: dict, hidden: torch.Tensor, tokens: torch.Tensor,
             gradients: bool) -> dict:
    """loss(hidden, tokens), and with `gradients` the gradients of hidden and of every parameter by name."""
    model = build(module, config, weights)
    hidden = hidden.detach().requires_grad_(gradients)
    loss = model.loss(hidden, tokens)
    report = {"loss": loss.detach() if isinstance(loss, torch.Tensor) else loss, "grads": None}
    if gradients and isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
        report["grads"] = {"hidden": hidden.grad, **{name: p.grad for name, p in model.named_parameters()}}
    return report


def call_invalid(module, method: str, hidden_shape: tuple, tokens_shape: tuple, tokens_dtype: str) -> None:
    """One faulty call of forward or loss on a model of depth 2, d_model 8, vocab 11."""
    model = module.MultiTokenPrediction(module.MTPConfig(vocab_size=11, d_model=8, n_heads=2, depth=2))
    tokens = torch.zeros(tokens_shape, dtype=getattr(torch, tokens_dtype))
    getattr(model, method)(torch.ones(hidden_shape), tokens)
