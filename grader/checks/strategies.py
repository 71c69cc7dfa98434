"""Hypothesis strategies shared by every problem: sizes that break tiling, layouts, value regimes.

Tensors are not drawn element by element: a case holds a shape, dtype, layout, value regime and seed, and builds its
tensor deterministically. That keeps drawing fast, shrinks towards small shapes, and makes the case's repr a complete
recipe for reproducing it.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from grader.checks import profiles
from grader.checks.compare import SHOWN_WHOLE, inputs_if_small
from grader.checks.profiles import SIZE_SCALE
from grader.session.context import secret_seed

LAYOUTS = ("contiguous", "transposed", "sliced", "offset")
# Every layout the kernels' contracts name ("any strides"): also the first dim broadcast (stride 0, as
# `x[None].expand(...)` gives) and rows that are not adjacent (the first n columns of a wider tensor).
ALL_LAYOUTS = LAYOUTS + ("expanded", "row_padded")
ROW_PADDING = 3  # odd: padded rows start at addresses no block size divides
# What each regime is for: normal values; large magnitudes that overflow exp() without max-subtraction; many exact
# ties (small integers) that expose unstable tie-breaking; tiny magnitudes near the dtype's resolution.
REGIMES = ("normal", "large", "ties", "tiny")


def size_scale() -> int:
    """How much larger than the `ci` sizes this run may draw (larger still on a GPU)."""
    return SIZE_SCALE[profiles.active()] * (8 if torch.cuda.is_available() else 1)


def dims(max_size: int, tiles: tuple[int, ...] = (16, 32, 64, 128)) -> st.SearchStrategy[int]:
    """Sizes from 1 to max_size, favouring 1, small primes and each tile size plus and minus one."""
    special = {1, 2, 3, 5, 7} | {t + d for t in tiles for d in (-1, 0, 1)}
    special = sorted(s for s in special if 1 <= s <= max_size)
    return st.one_of(st.sampled_from(special), st.integers(1, max_size))


def long_lengths(low: int, high: int) -> st.SearchStrategy[int]:
    """Row lengths from low to high, favouring 2^p + 1: one element past a whole number of blocks for every
    power-of-two block size up to 2^p, where a dropped or doubled last element shows."""
    just_past = [2**p + 1 for p in range(4, 40) if low <= 2**p + 1 <= high]
    return st.one_of(st.sampled_from(just_past), st.integers(low, high)) if just_past else st.integers(low, high)


def values(shape: tuple[int, ...], regime: str, generator: torch.Generator) -> torch.Tensor:
    """float64 values on the CPU for one regime."""
    if regime == "normal":
        return torch.randn(shape, generator=generator, dtype=torch.float64)
    if regime == "large":
        return torch.randn(shape, generator=generator, dtype=torch.float64) * 1e4
    if regime == "ties":
        return torch.randint(-2, 3, shape, generator=generator).to(torch.float64)
    if regime == "tiny":
        return torch.randn(shape, generator=generator, dtype=torch.float64) * 1e-3
    if regime == "cancelling":
        # Integers from 256 to 1023 in the first half of the last dim, and in the second half the same integers
        # negated, each moved by -2 to 2: running sums along a row climb past 2048 within a few terms and fall back
        # to a small total. Exact in a float32 accumulator; a float16 one rounds every partial sum past 2048.
        integers = torch.randint(256, 1024, shape, generator=generator).to(torch.float64)
        if shape:
            half = shape[-1] // 2
            nudges = torch.randint(-2, 3, (*shape[:-1], shape[-1] - half), generator=generator).to(torch.float64)
            integers[..., half:] = nudges
            integers[..., shape[-1] - half:] -= integers[..., :half].flip(-1)
        return integers
    raise ValueError(f"unknown regime {regime!r}")


@dataclass(frozen=True)
class TensorCase:
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str = "contiguous"
    regime: str = "normal"
    seed: int = 0

    def make(self, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor, in `dtype` (default: the case's), laid out as the case says: same values in every dtype."""
        generator = torch.Generator().manual_seed(self.seed)
        dtype = dtype or self.dtype
        shape = self.shape
        if self.layout == "transposed" and len(shape) >= 2:
            # Stored with the last two dims swapped, then viewed back: the last dim is not unit-stride.
            swapped = (*shape[:-2], shape[-1], shape[-2])
            base = values(swapped, self.regime, generator).to(dtype).to(device)
            return base.transpose(-1, -2)
        if self.layout == "sliced":
            # Every other element of a twice-as-wide tensor: the last dim has stride 2.
            wide = (*shape[:-1], 2 * shape[-1]) if shape else shape
            base = values(wide, self.regime, generator).to(dtype).to(device)
            return base[..., ::2] if shape else base
        if self.layout == "expanded" and shape:
            base = values((1, *shape[1:]), self.regime, generator).to(dtype).to(device)
            return base.expand(shape)
        if self.layout == "row_padded" and shape:
            wide = (*shape[:-1], shape[-1] + ROW_PADDING)
            return values(wide, self.regime, generator).to(dtype).to(device)[..., : shape[-1]]
        if self.layout == "offset":
            # A view starting one element into its storage: alignment assumptions break.
            count = 1
            for size in shape:
                count *= size
            base = values((count + 1,), self.regime, generator).to(dtype).to(device)
            return base[1:].view(shape)
        return values(shape, self.regime, generator).to(dtype).to(device)

    def describe(self) -> str:
        return (
            f"shape={self.shape}, dtype={str(self.dtype).removeprefix('torch.')}, layout={self.layout}, "
            f"values={self.regime}, seed={self.seed}"
        ) + (inputs_if_small(elements=self.make("cpu")) if _product(self.shape) <= SHOWN_WHOLE else "")


def tensor_cases(
    shapes: st.SearchStrategy[tuple[int, ...]],
    dtype: torch.dtype | st.SearchStrategy[torch.dtype],
    layouts: tuple[str, ...] = ALL_LAYOUTS,
    regimes: tuple[str, ...] = REGIMES,
) -> st.SearchStrategy[TensorCase]:
    return st.builds(
        TensorCase,
        shape=shapes,
        dtype=dtype if isinstance(dtype, st.SearchStrategy) else st.just(dtype),
        layout=st.sampled_from(layouts),
        regime=st.sampled_from(regimes),
        seed=st.integers(0, 2**31 - 1),
    )


def leading_shapes(max_rows: int, max_dims: int = 3) -> st.SearchStrategy[tuple[int, ...]]:
    """Leading dimensions (possibly none) whose product is at most max_rows."""
    return st.lists(st.integers(1, 8), min_size=0, max_size=max_dims - 1).filter(
        lambda dims_: _product(dims_) <= max_rows
    ).map(tuple)


def _product(sizes) -> int:
    result = 1
    for size in sizes:
        result *= size
    return result


def data_seeds() -> st.SearchStrategy[int]:
    """Seeds of the data a parallel grader builds for its ranks. In the grading profile each drawn seed is keyed with
    the secret seed, so that a rank, which sees only its own share of the data, cannot search the drawn seeds' small
    space to rebuild its peers' shares; elsewhere the drawn seed is used as it is (public inputs are public anyway)."""
    return st.integers(0, 2**20).map(keyed_seed)


def keyed_seed(seed: int) -> int:
    """HMAC-SHA256 of the drawn seed under the secret seed, 40 bits (so that seed arithmetic stays within int64)."""
    if profiles.active() != "grading":
        return seed
    digest = hmac.new(str(secret_seed()).encode(), str(seed).encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:5], "big")

