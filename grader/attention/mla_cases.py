"""What attention.mla's tests share: a layer's sizes and weights, and the programs that run it inside the worker (the
student's module) or in the grader's process (the reference's, at the case's dtype and at float64, the oracle).

The weights are the grader's, drawn by the pinned parameter names and loaded into both modules. A prefill's cache
leaves the layer as the rows of the tokens it holds, and decoding continues from them in a fresh layer, in a cache
of the grader's with room to append in place: what decoding needs must be in the cache. Decoding runs under a
recorder of every tensor an operator returns, and the grader compares the memory of the cache each step was given
with the one it returned (both inside the worker: evidence against honest mistakes). It searches the first for
per-head keys or values of the whole cache, one tensor at a time and as the total a step builds over the cache's
length; the second tells a step that appended in place from one that copied its cache.

The hybrid's cases (grader/attention/hybrid_cases.py) have the same shape and, for the reasons written there, no
code in common with these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from grader.checks.strategies import size_scale
from grader.session.context import current


@dataclass(frozen=True)
class MLACase:
    batch: int
    seq: int
    d_model: int
    n_heads: int
    head_dim: int
    latent_dim: int
    rope_dim: int
    dtype: torch.dtype = torch.float32
    prefill: int = 1  # tokens given to prefill before decoding the rest one at a time
    seed: int = 0

    def config(self) -> dict:
        return {"d_model": self.d_model, "n_heads": self.n_heads, "head_dim": self.head_dim,
                "latent_dim": self.latent_dim, "rope_dim": self.rope_dim}

    def parameters(self) -> dict[str, torch.Tensor]:
        """The weights by their pinned names, in float64 holding values exact in the case's dtype."""
        generator = torch.Generator().manual_seed(self.seed)
        heads = self.n_heads * self.head_dim

        def linear(rows, columns):
            return torch.randn(rows, columns, generator=generator, dtype=torch.float64) * columns**-0.5

        weights = {"kv_down.weight": linear(self.latent_dim, self.d_model),
                   "key_up.weight": linear(heads, self.latent_dim),
                   "value_up.weight": linear(heads, self.latent_dim),
                   "rope_key.weight": linear(self.rope_dim, self.d_model),
                   "query.weight": linear(self.n_heads * (self.head_dim + self.rope_dim), self.d_model),
                   "out.weight": linear(self.d_model, heads)}
        return {name: tensor.to(self.dtype).double() for name, tensor in weights.items()}

    def exact_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """h and the upstream gradient of the output, float64 holding values exact in the case's dtype."""
        generator = torch.Generator().manual_seed(self.seed + 1)
        shape = (self.batch, self.seq, self.d_model)
        h = torch.randn(shape, generator=generator, dtype=torch.float64) * 2
        grad = torch.randn(shape, generator=generator, dtype=torch.float64)
        return h.to(self.dtype).double(), grad.to(self.dtype).double()

    def describe(self) -> str:
        return (f"batch={self.batch}, seq={self.seq}, d_model={self.d_model}, n_heads={self.n_heads}, "
                f"head_dim={self.head_dim}, latent_dim={self.latent_dim}, rope_dim={self.rope_dim}, "
                f"dtype={str(self.dtype).removeprefix('torch.')}, prefill={self.prefill}, seed={self.seed}")


@st.composite
def mla_cases(draw, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> MLACase:
    """Small layers: sequences up to 24 under `ci` on a CPU (RoPE angles past 20 radians at the fastest pair)."""
    seq = draw(st.integers(1, 24 * size_scale()))
    return MLACase(
        batch=draw(st.integers(1, 3)),
        seq=seq,
        d_model=draw(st.sampled_from([16, 32])),
        n_heads=draw(st.integers(1, 4)),
        head_dim=draw(st.sampled_from([4, 8, 16])),
        latent_dim=draw(st.sampled_from([4, 12, 24])),
        rope_dim=draw(st.sampled_from([2, 4, 8])),
        dtype=draw(st.sampled_from(dtypes)),
        prefill=draw(st.integers(1, seq)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def case_tensors(case: MLACase, dtype: torch.dtype | None = None) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(weights, h, grad) at `dtype` (the case's by default) on the grader's device."""
    dtype = dtype or case.dtype
    device = current().device
    h, grad = case.exact_inputs()
    weights = {name: tensor.to(device, dtype) for name, tensor in case.parameters().items()}
    return weights, h.to(device, dtype), grad.to(device, dtype)


# --- programs: run in the worker on the student's module, and here on the reference's ------------------------------


def build(module, config: dict, weights: dict):
    any_weight = next(iter(weights.values()))
    layer = module.MultiHeadLatentAttention(module.MLAConfig(**config)).to(any_weight.device, any_weight.dtype)
    layer.load_state_dict(weights)
    return layer


def run_forward(module, config: dict, weights: dict, h: torch.Tensor, grad: torch.Tensor | None) -> dict:
    """forward(h), and with grad the gradients of h and of every parameter by name."""
    layer = build(module, config, weights)
    h = h.detach().requires_grad_(grad is not None)
    y = layer(h)
    report = {"y": y.detach() if isinstance(y, torch.Tensor) else y, "grads": None}
    if grad is not None and isinstance(y, torch.Tensor) and y.requires_grad:
        y.backward(grad)
        report["grads"] = {"h": h.grad, **{name: p.grad for name, p in layer.named_parameters()}}
    return report


def held_rows(cache) -> list:
    """A cache's latent and rotary-key rows of the tokens it holds (its first `length`), copied: what decoding
    later writes into the room after them cannot change them."""
    length = cache.length
    return [t[:, :length].detach().clone() if isinstance(t, torch.Tensor) and isinstance(length, int) else t
            for t in (cache.latent, cache.rope_key)]


def with_room(module, rows: list, length: int, capacity: int):
    """The grader's cache of `length` tokens for a fresh layer: the held rows copied into zeroed rows of `capacity`
    tokens, so that the first decode steps append in place and a later one must grow it. Rows that are not
    [B, length, size] tensors are passed on as they came (the student's decode then meets them)."""
    if not all(isinstance(t, torch.Tensor) and t.ndim == 3 and t.shape[1] == length for t in rows):
        return module.MLACache(*rows, length=length)
    roomy = [t.new_zeros(t.shape[0], capacity, t.shape[2]) for t in rows]
    for held, room in zip(rows, roomy):
        room[:, :length] = held
    return module.MLACache(*roomy, length=length)


def memory_of(cache) -> tuple:
    """Where the cache's two tensors' storage starts (None for what is not a tensor): the same after a step that
    appended in place."""
    return tuple(t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
                 for t in (cache.latent, cache.rope_key))


class _DecodeRecorder(TorchDispatchMode):
    """What one decode step builds: every tensor an operator returns with `limit` elements or more and a dimension of
    `length` (the tokens cached before the step) or `length + 1` (after it), and the elements of every tensor an
    operator returns in new memory (views and in-place results build nothing). The step's fixed work cancels out
    between two steps' totals: what is left is the work that grows with the cache."""

    def __init__(self, limit: int, length: int):
        super().__init__()
        self.limit, self.length, self.seen, self.elements = limit, length, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        memory_in = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                     if isinstance(t, torch.Tensor)}
        for tensor in result if isinstance(result, (tuple, list)) else (result,):
            if not isinstance(tensor, torch.Tensor):
                continue
            if tensor.untyped_storage().data_ptr() not in memory_in:
                self.elements += tensor.numel()
            if (tensor.numel() >= self.limit and any(size in (self.length, self.length + 1) for size in tensor.shape)
                    and len(self.seen) < 10):
                self.seen.append(f"{func} -> {tuple(tensor.shape)}")
        return result


@torch.no_grad()
def run_prefill_decode(module, config: dict, weights: dict, h: torch.Tensor, prefill: int) -> dict:
    """prefill(h[:, :prefill]), then decode every later token one at a time in a fresh layer from the grader's cache
    of the prefill's rows, with room for half the tokens still to come (with_room): the outputs, the rows held after
    prefill and at the end, each length, cache_bytes_per_token and the last cache's tensors' bytes and capacities,
    the large tensors decoding built (see _DecodeRecorder: as many elements as every cached token's per-head keys),
    per decode step the tokens cached before it and the elements of the tensors it built, and the steps that had
    room yet returned the cache in other memory than the one they were given."""
    prefilled, cache = build(module, config, weights).prefill(h[:, :prefill])
    entries, prefill_length = held_rows(cache), cache.length
    layer = build(module, config, weights)
    cache = with_room(module, entries, prefill, (prefill + h.shape[1]) // 2)
    outputs, large, built, moved = [prefilled], [], [], []
    per_head = h.shape[0] * config["n_heads"] * config["head_dim"]
    for t in range(prefill, h.shape[1]):
        given, room = memory_of(cache), t < cache.latent.shape[1]
        with _DecodeRecorder(per_head * t, t) as recorder:
            y_t, cache = layer.decode(h[:, t:t + 1], cache)
        if room and given != memory_of(cache):
            moved.append(t)
        outputs.append(y_t)
        large += recorder.seen
        built.append((t, recorder.elements))
    rows = [t for t in (cache.latent, cache.rope_key) if isinstance(t, torch.Tensor)]
    return {"y": torch.cat(outputs, dim=1), "prefill_cache": entries, "prefill_length": prefill_length,
            "cache": held_rows(cache), "length": cache.length, "bytes_per_token": layer.cache_bytes_per_token(),
            "cache_bytes": sum(t.numel() * t.element_size() for t in rows), "capacities": [t.shape[1] for t in rows],
            "large": large[:10], "built": built, "moved": moved}


def call_invalid(module, method: str, shape: tuple[int, ...], dtype: str) -> None:
    """One faulty call: forward, or decode after a prefill of two tokens of batch 1, on a layer of d_model 16."""
    layer = module.MultiHeadLatentAttention(module.MLAConfig(d_model=16, n_heads=2, head_dim=4, latent_dim=6,
                                                             rope_dim=4))
    h = torch.ones(shape, dtype=getattr(torch, dtype))
    with torch.no_grad():
        if method == "forward":
            layer(h)
            return
        _, cache = layer.prefill(torch.ones(1, 2, 16))
        layer.decode(h, cache)
