"""One decoding step of the multi-head latent attention reference (its absorbed decode path) against standard
multi-head attention of the same width, at batch 64 and a context of up to 8192 tokens, on one GPU.

    python benchmarks/mla_decode.py           # prints the table and writes benchmarks/results/mla_decode.md
    python benchmarks/mla_decode.py --quick   # tiny sizes on the CPU in float32, printed only: a smoke test

Layers: two DeepSeek-V2-like ones scaled to one GPU, head size d_h = 128, latent d_c = 512, rotary key d_r = 64,
with d_model 2048 and 16 heads, and d_model 4096 and 32 heads; bfloat16; contexts T = 2048, 4096 and 8192.

- MLA: the cache of T tokens is built directly as random latents [B, T, d_c] and rotary keys [B, T, d_r] (the
  decode path takes any MLACache and places the new token at position T), with room for that token, and one step is
  MultiHeadLatentAttention.decode of one new token per sequence. Its cache is (d_c + d_r) elements per token, shown
  from the model's cache_bytes_per_token and from the cache tensors' bytes over their tokens.
- MHA: K and V caches [B, H, T + 1, d_h] preallocated with room for the new token; one step projects the token's q,
  k and v, writes k and v in place at position T, attends 1 query over T + 1 keys per head
  (scaled_dot_product_attention, any backend: a benchmark-only baseline) and projects the heads out. Its cache is
  2 H d_h elements per token. Rotary positions are left out: they touch one token, not the cache.

Memory: the largest MHA cache, d_model 4096 at T = 8192, is 64 x 32 heads x 8192 x 128 x 2 (k, v) x 2 bytes = 8 GiB,
one layer's worth, beside the MLA cache of 0.56 GiB and a copy of it: all well within an H200.

At batch 64 a decoding step is bound by memory traffic, the cache's above all, so the time ratio should follow the
bytes ratio, 2 H d_h / (d_c + d_r), less what the absorbed path adds: its extra matmuls (each head's query moved into
the d_c-wide latent space, d_c-wide scores and weighted sums, each head's value up-projection). The reference's
decode writes the new token into its cache's room in place, as MHA's does, and on a GPU reads a bfloat16 cache once,
in one Triton kernel. The GB/s columns, cache bytes over step time, show how close each step comes to reading its
cache at the GPU's bandwidth, which a copy of the MLA cache's bytes (read and written) measures in the same run.
Each step is timed replayed from a CUDA graph (the GPU's time) and called from Python (eager, which adds the host's
launch cost of a few dozen small operators).

Before timing, each layer's decode output for token T' (from the cache of a prefill of T' tokens) is checked against
the naive forward over T' + 1 tokens, so that a wrong use of the decode API shows. Times are medians of CUDA-event
timings (triton.testing.do_bench) under torch.inference_mode; the quick run takes medians of time.perf_counter.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.cuda_graphs import replay_ms
from reference.attention.mla import MLACache, MLAConfig, MultiHeadLatentAttention

BATCH = 64
CONTEXTS = (2048, 4096, 8192)
LAYERS = (MLAConfig(d_model=2048, n_heads=16, head_dim=128, latent_dim=512, rope_dim=64),
          MLAConfig(d_model=4096, n_heads=32, head_dim=128, latent_dim=512, rope_dim=64))
DTYPE = torch.bfloat16
CHECK_BATCH, CHECK_CONTEXT = 2, 128
RESULTS = ROOT / "benchmarks" / "results" / "mla_decode.md"

QUICK_BATCH = 2
QUICK_CONTEXTS = (64,)
QUICK_LAYERS = (MLAConfig(d_model=64, n_heads=2, head_dim=16, latent_dim=32, rope_dim=8),)
QUICK_DTYPE = torch.float32
QUICK_CHECK_CONTEXT = 16
QUICK_WARMUP, QUICK_REPEATS = 3, 20

# Relative to the naive output's largest entry: both paths accumulate in float32 and round their heads to the model's
# dtype before the output projection, where one bfloat16 rounding may land on either side.
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
GIB = 2**30


@dataclass(frozen=True)
class Setting:
    device: str
    dtype: torch.dtype
    batch: int
    contexts: tuple[int, ...]
    layers: tuple[MLAConfig, ...]
    check_context: int
    milliseconds: Callable[[Callable[[], object]], float]  # the step as called, from Python
    replayed_milliseconds: Callable[[Callable[[], object]], float]  # the step without its launch cost


@dataclass(frozen=True)
class Row:
    config: MLAConfig
    context: int
    mla_ms: float
    mha_ms: float
    mla_eager_ms: float
    mha_eager_ms: float
    mla_bytes_per_token_model: int
    mla_bytes_per_token_tensors: float
    mha_bytes_per_token: int
    mla_cache_bytes: int
    mha_cache_bytes: int
    copy_ms: float  # a copy of the MLA cache's bytes into another buffer, replayed as the steps are


class MultiHeadDecoder(nn.Module):
    """Standard multi-head attention of MLA's width: H heads of d_h, decoding against a preallocated K, V cache."""

    def __init__(self, config: MLAConfig) -> None:
        super().__init__()
        self.config = config
        width = config.n_heads * config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * width, bias=False)
        self.out = nn.Linear(width, config.d_model, bias=False)

    def decode(self, h: Tensor, keys: Tensor, values: Tensor, position: int) -> Tensor:
        """One token h [B, 1, d_model] at `position`: its k, v written into keys, values [B, H, capacity, d_h]."""
        c, batch = self.config, h.shape[0]
        q, k, v = self.qkv(h).view(batch, 3, c.n_heads, c.head_dim).unbind(1)  # each [B, H, d_h]
        keys[:, :, position] = k
        values[:, :, position] = v
        visible = slice(0, position + 1)
        heads = F.scaled_dot_product_attention(q[:, :, None], keys[:, :, visible], values[:, :, visible])
        return self.out(heads.reshape(batch, 1, c.n_heads * c.head_dim))


def random_tensor(setting: Setting, *shape: int) -> Tensor:
    return torch.randn(shape, device=setting.device, dtype=setting.dtype)


def mla_cache(setting: Setting, config: MLAConfig, context: int) -> MLACache:
    """What a prefill of `context` tokens leaves, drawn at random (the step's time does not depend on the values),
    with room for the token being decoded."""
    return MLACache(latent=random_tensor(setting, setting.batch, context + 1, config.latent_dim),
                    rope_key=random_tensor(setting, setting.batch, context + 1, config.rope_dim), length=context)


def mha_cache(setting: Setting, config: MLAConfig, context: int) -> tuple[Tensor, Tensor]:
    """K and V [B, H, context + 1, d_h]: `context` tokens of a prefill, and room for the one being decoded."""
    shape = (setting.batch, config.n_heads, context + 1, config.head_dim)
    return random_tensor(setting, *shape), random_tensor(setting, *shape)


def gpu_milliseconds(step: Callable[[], object]) -> float:
    import triton.testing  # only here, so that the quick run works where triton is missing

    return triton.testing.do_bench(step, warmup=5, rep=100, return_mode="median")


def cpu_milliseconds(step: Callable[[], object]) -> float:
    for _ in range(QUICK_WARMUP):
        step()
    seconds = []
    for _ in range(QUICK_REPEATS):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3


def describe(config: MLAConfig) -> str:
    return f"d_model {config.d_model}, {config.n_heads} heads"


def check_decode(setting: Setting, model: MultiHeadLatentAttention) -> str:
    """The decode output for the token after a prefill against the naive forward's output at that position."""
    context = setting.check_context
    h = random_tensor(setting, CHECK_BATCH, context + 1, model.config.d_model)
    _, cache = model.prefill(h[:, :context])
    decoded, _ = model.decode(h[:, context:], cache)
    naive = model(h)[:, context:]
    error = ((decoded.float() - naive.float()).abs().max() / naive.float().abs().max()).item()
    tolerance = CHECK_TOLERANCE[setting.dtype]
    line = (f"decode against naive forward, {describe(model.config)}, token {context}: relative max error "
            f"{error:.1e} (tolerance {tolerance:.0e})")
    if not error <= tolerance:  # written so that a NaN fails too
        raise SystemExit(f"{line}: the decode path disagrees with the naive forward")
    return line


def mla_step(setting: Setting, model: MultiHeadLatentAttention, context: int) -> tuple[float, float, float, int]:
    """(replayed step ms, eager step ms, cache bytes per token from the tensors, bytes of the `context` cached tokens)
    after a prefill of `context` tokens; every repeat writes the same row of the cache's room, row `context`."""
    cache = mla_cache(setting, model.config, context)
    h = random_tensor(setting, setting.batch, 1, model.config.d_model)
    cache_bytes = (cache.latent.nbytes + cache.rope_key.nbytes) * context // (context + 1)
    step = lambda: model.decode(h, cache)
    return (setting.replayed_milliseconds(step), setting.milliseconds(step), cache_bytes / (setting.batch * context),
            cache_bytes)


def mha_step(setting: Setting, model: MultiHeadDecoder, context: int) -> tuple[float, float, int]:
    """(replayed step ms, eager step ms, bytes of the K and V of `context` tokens); every repeat rewrites the same
    slot, position `context`."""
    keys, values = mha_cache(setting, model.config, context)
    h = random_tensor(setting, setting.batch, 1, model.config.d_model)
    step = lambda: model.decode(h, keys, values, context)
    prefilled = keys[:, :, :context]
    return (setting.replayed_milliseconds(step), setting.milliseconds(step),
            2 * prefilled.numel() * prefilled.element_size())


def copy_milliseconds(setting: Setting, nbytes: int) -> float:
    """A device-to-device copy of `nbytes`: it reads them and writes as many, the bandwidth a step's one read of its
    cache is measured against."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=setting.device)
    target = torch.empty_like(source)
    return setting.replayed_milliseconds(lambda: target.copy_(source))


def release_memory(setting: Setting) -> None:
    if setting.device == "cuda":
        torch.cuda.empty_cache()


def measure_layer(setting: Setting, mla: MultiHeadLatentAttention, mha: MultiHeadDecoder) -> list[Row]:
    config, rows = mla.config, []
    for context in setting.contexts:
        mla_ms, mla_eager_ms, mla_bytes_per_token, mla_bytes = mla_step(setting, mla, context)
        release_memory(setting)
        mha_ms, mha_eager_ms, mha_bytes = mha_step(setting, mha, context)
        release_memory(setting)
        copy_ms = copy_milliseconds(setting, mla_bytes)
        release_memory(setting)
        rows.append(Row(config, context, mla_ms, mha_ms, mla_eager_ms, mha_eager_ms, mla.cache_bytes_per_token(),
                        mla_bytes_per_token,
                        2 * config.n_heads * config.head_dim * setting.dtype.itemsize, mla_bytes, mha_bytes, copy_ms))
        print(table_line(rows[-1]), flush=True)
    return rows


def table_line(row: Row) -> str:
    mla_rate = row.mla_cache_bytes / row.mla_ms / 1e6  # bytes per ms / 1e6 = GB/s
    mha_rate = row.mha_cache_bytes / row.mha_ms / 1e6
    copy_rate = 2 * row.mla_cache_bytes / row.copy_ms / 1e6  # read and written
    return (f"| {describe(row.config)} | {row.context} | {row.mla_ms:.3f} | {row.mha_ms:.3f} | "
            f"{row.mha_ms / row.mla_ms:.2f} | {row.mla_eager_ms:.3f} | {row.mha_eager_ms:.3f} | "
            f"{row.mla_bytes_per_token_model} / {row.mla_bytes_per_token_tensors:.0f} | "
            f"{row.mha_bytes_per_token} | {row.mha_bytes_per_token / row.mla_bytes_per_token_model:.1f} | "
            f"{row.mla_cache_bytes / GIB:.3f} | {row.mha_cache_bytes / GIB:.3f} | {mla_rate:.0f} | {mha_rate:.0f} | "
            f"{copy_rate:.0f} | {mla_rate / copy_rate:.2f} |")


TABLE_HEADER = [
    "| layer | T | MLA ms | MHA ms | MHA / MLA time | MLA eager ms | MHA eager ms | MLA bytes / token "
    "(model / tensors) | MHA bytes / token | MHA / MLA bytes | MLA cache GiB | MHA cache GiB | MLA cache GB/s | "
    "MHA cache GB/s | copy GB/s | MLA / copy |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def write_results(setting: Setting, machine: str, checks: list[str], rows: list[Row]) -> None:
    sizes = setting.layers[0]  # the layers share their head, latent and rotary sizes
    RESULTS.write_text("\n".join([
        "# Multi-head latent attention: one decoding step against multi-head attention",
        "",
        f"Measured on {machine}. Batch {setting.batch}, head size {sizes.head_dim}, latent {sizes.latent_dim}, "
        f"rotary key {sizes.rope_dim}, {str(setting.dtype).removeprefix('torch.')}; one new token per sequence after "
        "a cache of T tokens; medians of CUDA-event timings, milliseconds, of the step replayed from a CUDA graph "
        "(MLA ms, MHA ms: the GPU's time) and called from Python (eager). Written by "
        "`python benchmarks/mla_decode.py`.",
        "",
        "MLA: the reference's absorbed decode path (`MultiHeadLatentAttention.decode`) from a cache of random latents "
        "and rotary keys. MHA: the same width's q, k, v projection, k and v written in place into a preallocated "
        "cache, scaled_dot_product_attention of 1 query over T + 1 keys per head, and the output projection. Bytes "
        "per token are per layer: (d_c + d_r) elements for MLA, 2 H d_h for MHA. Cache GB/s: the cache's bytes over "
        "the replayed step's time. Copy GB/s: a copy of the MLA cache's bytes, read and written, over its replayed "
        "time, the bandwidth the GPU gives a streaming kernel; MLA / copy: the MLA step's cache GB/s over it.",
        "",
        *TABLE_HEADER,
        *(table_line(row) for row in rows),
        "",
        "At this batch a decoding step is bound by memory traffic, so a step that read its cache once at the GPU's "
        "bandwidth would follow the bytes ratio. The reference's MLA decode appends in place, as MHA's does, and "
        "reads its bfloat16 cache once in one Triton kernel (flash-decoding over ranges of tokens, every head of a "
        "sequence scored against the same tile); the rest of its step is the token's projections and the per-head "
        "up-projections, whose weights it reads whatever T. The problem grades the cache, appending in place and "
        "the absorbed algebra, not that kernel.",
        "",
        "Checks, before timing (decode output after a prefill against the naive forward):",
        "",
        *(f"- {check}" for check in checks),
        "",
    ]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes on the CPU in float32, printed only")
    quick = parser.parse_args().quick
    if quick:
        setting = Setting("cpu", QUICK_DTYPE, QUICK_BATCH, QUICK_CONTEXTS, QUICK_LAYERS, QUICK_CHECK_CONTEXT,
                          cpu_milliseconds, cpu_milliseconds)
        machine = f"CPU, torch {torch.__version__}, Python {platform.python_version()}"
    else:
        import triton

        setting = Setting("cuda", DTYPE, BATCH, CONTEXTS, LAYERS, CHECK_CONTEXT, gpu_milliseconds,
                          replay_ms)
        machine = (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
                   f"Python {platform.python_version()}")
    print(machine, flush=True)
    torch.manual_seed(0)  # the same weights and inputs each run, so that the check's error repeats
    models = [(MultiHeadLatentAttention(config).to(setting.device, setting.dtype),
               MultiHeadDecoder(config).to(setting.device, setting.dtype)) for config in setting.layers]
    with torch.inference_mode():  # no autograd graph: a decoding step keeps nothing for a backward
        checks = [check_decode(setting, mla) for mla, _ in models]
        print("\n".join(checks), flush=True)
        print("\n".join(TABLE_HEADER), flush=True)
        rows = [row for mla, mha in models for row in measure_layer(setting, mla, mha)]
    if not quick:
        write_results(setting, machine, checks, rows)


if __name__ == "__main__":
    main()
