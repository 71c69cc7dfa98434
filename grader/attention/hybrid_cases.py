"""What attention.hybrid's tests share: a model's size and weights, the programs that run a stack inside the worker
(the student's) or in the grader's process (the reference's, at the case's dtype and at float64, the oracle), and
the cache as the grader measures it.

The weights are the grader's: drawn by the pinned parameter names and loaded into both stacks, so every comparison is
of one model. A cache travels back to the grader as plain tensors, and decoding continues from them in a fresh
stack built from the same weights: what decoding needs must be in the cache, not in the module.

It has the shape of grader/attention/mla_cases.py (a case, its weights, worker programs, oracle) and no code in
common with it: the two draw other parameters, cache other tensors (per layer states and keys here, a latent there)
and search the decoding for other things, so a shared base would hold only the names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from grader.checks.strategies import size_scale
from grader.session.context import current

# The cache test: bytes after a short and a long prefill (a GDN state must not grow; a KV cache grows by 64x).
SHORT_PREFILL, LONG_PREFILL = 64, 4096


@dataclass(frozen=True)
class HybridCase:
    batch: int
    seq: int
    d_model: int
    n_heads: int
    head_dim: int
    n_layers: int
    attention_every: int
    dtype: torch.dtype = torch.float32
    prefill: int = 1  # tokens given to prefill before decoding the rest one at a time
    seed: int = 0

    def config(self) -> dict:
        return {"d_model": self.d_model, "n_heads": self.n_heads, "head_dim": self.head_dim,
                "n_layers": self.n_layers, "attention_every": self.attention_every}

    def attention_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if i % self.attention_every == self.attention_every - 1]

    def parameters(self) -> dict[str, torch.Tensor]:
        """The weights by their pinned names, in float64 holding values exact in the case's dtype."""
        generator = torch.Generator().manual_seed(self.seed)
        inner = self.n_heads * self.head_dim

        def normal(*shape, scale=1.0, shift=0.0):
            return torch.randn(shape, generator=generator, dtype=torch.float64) * scale + shift

        weights = {}
        for layer in range(self.n_layers):
            prefix = f"layers.{layer}."
            weights[prefix + "norm.weight"] = normal(self.d_model, scale=0.1, shift=1.0)
            for name in ("q_proj", "k_proj", "v_proj"):
                weights[prefix + f"mixer.{name}.weight"] = normal(inner, self.d_model, scale=self.d_model**-0.5)
            if layer not in self.attention_layers():
                weights[prefix + "mixer.g_proj.weight"] = normal(self.n_heads, self.d_model, scale=self.d_model**-0.5)
                weights[prefix + "mixer.g_proj.bias"] = normal(self.n_heads, shift=-2.0)
                weights[prefix + "mixer.beta_proj.weight"] = normal(self.n_heads, self.d_model,
                                                                    scale=self.d_model**-0.5)
                weights[prefix + "mixer.beta_proj.bias"] = normal(self.n_heads)
            weights[prefix + "mixer.o_proj.weight"] = normal(self.d_model, inner, scale=inner**-0.5)
        weights["final_norm.weight"] = normal(self.d_model, scale=0.1, shift=1.0)
        return {name: tensor.to(self.dtype).double() for name, tensor in weights.items()}

    def exact_inputs(self, seq: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x and the upstream gradient of y, float64 holding values exact in the case's dtype."""
        generator = torch.Generator().manual_seed(self.seed + 1)
        shape = (self.batch, seq or self.seq, self.d_model)
        x = torch.randn(shape, generator=generator, dtype=torch.float64)
        grad_y = torch.randn(shape, generator=generator, dtype=torch.float64)
        return x.to(self.dtype).double(), grad_y.to(self.dtype).double()

    def describe(self) -> str:
        pattern = "".join("A" if i in self.attention_layers() else "L" for i in range(self.n_layers))
        return (f"batch={self.batch}, seq={self.seq}, d_model={self.d_model}, n_heads={self.n_heads}, "
                f"head_dim={self.head_dim}, layers={pattern} (attention_every={self.attention_every}), "
                f"dtype={str(self.dtype).removeprefix('torch.')}, prefill={self.prefill}, seed={self.seed}")


@st.composite
def hybrid_cases(draw, dtypes: tuple[torch.dtype, ...] = (torch.float32,), max_seq: int | None = None) -> HybridCase:
    """Small stacks: sequences up to 24 under `ci` on a CPU, longer with more room; 1 to 8 layers of every pattern."""
    seq = draw(st.integers(1, max_seq or 24 * size_scale()))
    n_layers = draw(st.integers(1, 8))
    return HybridCase(
        batch=draw(st.integers(1, 3)),
        seq=seq,
        d_model=draw(st.sampled_from([16, 32, 48])),
        n_heads=draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from([8, 16, 32])),
        n_layers=n_layers,
        attention_every=draw(st.integers(1, n_layers + 1)),
        dtype=draw(st.sampled_from(dtypes)),
        prefill=draw(st.integers(1, seq)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def case_tensors(case: HybridCase, dtype: torch.dtype | None = None) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(weights, x, grad_y) at `dtype` (the case's by default) on the grader's device."""
    dtype = dtype or case.dtype
    device = current().device
    x, grad_y = case.exact_inputs()
    weights = {name: tensor.to(device, dtype) for name, tensor in case.parameters().items()}
    return weights, x.to(device, dtype), grad_y.to(device, dtype)


# --- programs: run in the worker on the student's module, and here on the reference's ------------------------------


def build(module, config: dict, weights: dict):
    """A stack of `module` with the given weights, in their dtype and on their device."""
    any_weight = next(iter(weights.values()))
    model = module.HybridStack(module.HybridConfig(**config)).to(any_weight.device, any_weight.dtype)
    model.load_state_dict(weights)
    return model


def run_forward(module, config: dict, weights: dict, x: torch.Tensor, grad_y: torch.Tensor | None) -> dict:
    """forward(x), and with grad_y the gradients of x and of every parameter by name."""
    model = build(module, config, weights)
    x = x.detach().requires_grad_(grad_y is not None)
    y = model(x)
    report = {"y": y.detach() if isinstance(y, torch.Tensor) else y, "grads": None}
    if grad_y is not None and isinstance(y, torch.Tensor) and y.requires_grad:
        y.backward(grad_y)
        report["grads"] = {"x": x.grad, **{name: p.grad for name, p in model.named_parameters()}}
    return report


def plain_cache(cache) -> list:
    """cache.layers as plain tensors and tuples of tensors (what the wire carries)."""
    entries = []
    for entry in cache.layers:
        if isinstance(entry, (tuple, list)):
            entries.append(tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in entry))
        else:
            entries.append(entry.detach() if isinstance(entry, torch.Tensor) else entry)
    return entries


@torch.no_grad()
def run_prefill(module, config: dict, weights: dict, x: torch.Tensor) -> dict:
    """prefill(x): its y, its cache as plain entries, and cache_bytes of that cache."""
    model = build(module, config, weights)
    y, cache = model.prefill(x)
    return {"y": y, "cache": plain_cache(cache), "cache_bytes": module.cache_bytes(cache)}


@torch.no_grad()
def run_decode(module, config: dict, weights: dict, x: torch.Tensor, cache_entries: list) -> dict:
    """Decode x[:, t] for every t, one token at a time, in a fresh stack from a cache rebuilt of plain entries: the
    outputs, the final cache as plain entries, and cache_bytes of it."""
    model = build(module, config, weights)
    cache = module.HybridCache(layers=[tuple(e) if isinstance(e, (tuple, list)) else e for e in cache_entries])
    outputs = [x[:, :0]]  # no token to decode: an empty y
    for t in range(x.shape[1]):
        y_t, cache = model.decode(x[:, t:t + 1], cache)
        outputs.append(y_t)
    return {"y": torch.cat(outputs, dim=1), "cache": plain_cache(cache), "cache_bytes": module.cache_bytes(cache)}


def entry_bytes(entry) -> int:
    """The bytes of the tensors of one cache entry, as the grader counts them."""
    tensors = entry if isinstance(entry, (tuple, list)) else (entry,)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def call_invalid(module, method: str, shape: tuple[int, ...]) -> None:
    """One faulty call: forward or decode (after a prefill of one token, batch 1) of an input of `shape` to a stack of
    d_model 32."""
    config = module.HybridConfig(d_model=32, n_heads=2, head_dim=8, n_layers=4, attention_every=2)
    model = module.HybridStack(config)
    if method == "forward":
        model(torch.ones(shape))
        return
    with torch.no_grad():
        _, cache = model.prefill(torch.ones(1, 1, 32))
        model.decode(torch.ones(shape), cache)
