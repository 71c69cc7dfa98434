"""The MLA reference's decode kernel (its path for a bfloat16 cache on a GPU, reference.attention.mla) against its
plain path: the same weighted sums of latents, whichever split of the cached tokens. On the CPU it runs through
Triton's interpreter in float32 (the interpreter's bfloat16 is wrong); on a GPU in bfloat16 as well, where its
error must stay at the plain path's over a float32 copy of the cache."""

from __future__ import annotations

import math

import pytest
import torch

from reference.attention import mla

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def plain_mixed(q_latent, q_rope, cache: mla.MLACache, scale: float) -> torch.Tensor:
    """What the kernel computes, in float64 from the cache's values."""
    latent = cache.latent[:, :cache.length].double()
    rope_key = cache.rope_key[:, :cache.length].double()
    scores = q_latent.double() @ latent.transpose(1, 2) + q_rope.double() @ rope_key.transpose(1, 2)
    return torch.softmax(scores * scale, dim=-1) @ latent


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("batch, heads, latent_dim, rope_dim, length, capacity, splits", [
    (2, 3, 12, 4, 1, 1, 8),  # one token: one split of one tile
    (1, 4, 24, 2, 45, 64, 8),  # tiles cut by the length, room after it
    (3, 17, 32, 8, 100, 100, 3),  # heads past one block of 16, uneven splits
])
def test_kernel_matches_the_plain_sum(dtype, batch, heads, latent_dim, rope_dim, length, capacity, splits):
    generator = torch.Generator().manual_seed(length)
    q_latent = torch.randn(batch, heads, latent_dim, generator=generator).to(DEVICE)
    q_rope = torch.randn(batch, heads, rope_dim, generator=generator).to(DEVICE)
    cache = mla.MLACache(torch.randn(batch, capacity, latent_dim, generator=generator).to(DEVICE, dtype),
                         torch.randn(batch, capacity, rope_dim, generator=generator).to(DEVICE, dtype), length)
    scale = 1 / math.sqrt(latent_dim)
    got = mla._latent_attention(q_latent, q_rope, cache, scale, splits)
    exact = plain_mixed(q_latent, q_rope, cache, scale)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    error = (got.double() - exact).abs().max().item()
    # float32 scores of O(10) carry errors near 1e-6; a bfloat16 q rounded without its second term would be off by
    # about 1e-2 here.
    assert error < (1e-5 if dtype == torch.float32 else 2e-4), error
