"""The hybrid stack section of the handout: the handoff it derives, its decode algorithm and every byte count it
prints, checked in float64 against the reference.

Algorithm 1's decode step is written here from a float64 reference stack's weights (RMSNorm, the Gated DeltaNet step
S <- e^g S, S <- S + beta k (v - S^T k)^T, o = S^T q, and attention over every cached key with no mask) and run from
the reference's prefill cache: every decoded output matches the whole-sequence forward, and the cache it leaves
matches the reference's decode. The chunked form's final state, over a partial last chunk, is the recurrence's S_T.
The cache-bytes formula, the worked example's numbers and the self-check's answers are recomputed from the
reference's actual caches.
"""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from reference.attention.hybrid import HybridConfig, HybridStack, _chunked_delta_rule, cache_bytes

pytestmark = pytest.mark.usefixtures("float64_by_default")

SMALL = HybridConfig(d_model=16, n_heads=2, head_dim=8, n_layers=4, attention_every=2)


def stack(config=SMALL, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return HybridStack(config).to(dtype)


def rms_norm(x, norm):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def l2norm(z):
    return z / torch.sqrt(z.pow(2).sum(-1, keepdim=True) + 1e-6)


def decode_step(model, x_t, entries):
    """Algorithm 1's decode for one token x_t [B, d_model]; entries: per layer a state [B, H, d, d] or (K, V)."""
    config, new_entries = model.config, []
    heads, dim = config.n_heads, config.head_dim
    for block, entry in zip(model.layers, entries):
        u, mixer = rms_norm(x_t, block.norm), block.mixer
        q = mixer.q_proj(u).view(-1, heads, dim)
        k = mixer.k_proj(u).view(-1, heads, dim)
        v = mixer.v_proj(u).view(-1, heads, dim)
        if isinstance(entry, tuple):  # attention: append k, v; softmax over every cached row, no mask
            keys, values = torch.cat([entry[0], k[:, :, None]], 2), torch.cat([entry[1], v[:, :, None]], 2)
            weights = torch.softmax(torch.einsum("bhd,bhtd->bht", q, keys) / math.sqrt(dim), dim=-1)
            o = torch.einsum("bht,bhtd->bhd", weights, values)
            new_entries.append((keys, values))
        else:  # Gated DeltaNet: one step of the recurrence from the handed-over state
            q, k = l2norm(q) / math.sqrt(dim), l2norm(k)
            g = -F.softplus(mixer.g_proj(u))  # [B, H]
            beta = torch.sigmoid(mixer.beta_proj(u))
            state = g.exp()[..., None, None] * entry
            error = v - torch.einsum("bhkv,bhk->bhv", state, k)
            state = state + torch.einsum("bhk,bhv->bhkv", k, beta[..., None] * error)
            o = torch.einsum("bhkv,bhk->bhv", state, q)
            new_entries.append(state)
        x_t = x_t + mixer.o_proj(o.reshape(x_t.shape[0], heads * dim))
    return rms_norm(x_t, model.final_norm), new_entries


def test_prefill_then_the_sections_decode_reproduces_the_forward():
    model = stack()
    x = torch.randn(2, 11, SMALL.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
        _, cache = model.prefill(x[:, :6])
        entries = list(cache.layers)
        for t in range(6, 11):
            y, entries = decode_step(model, x[:, t], entries)
            assert torch.allclose(y, expected[:, t], atol=1e-12)
        _, reference_cache = model.prefill(x[:, :6])
        for t in range(6, 11):
            _, reference_cache = model.decode(x[:, t:t + 1], reference_cache)
    def tensors(entry):
        return entry if isinstance(entry, tuple) else (entry,)

    for mine, theirs in zip(entries, reference_cache.layers):
        for a, b in zip(tensors(mine), tensors(theirs)):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-12)


def test_the_chunked_final_state_is_the_recurrences_over_a_partial_chunk():
    gen = torch.Generator().manual_seed(2)
    batch, heads, n, dim = 1, 2, 70, 4  # 64 + 6: the last chunk is padded
    q = l2norm(torch.randn(batch, heads, n, dim, generator=gen))
    k = l2norm(torch.randn(batch, heads, n, dim, generator=gen))
    v = torch.randn(batch, heads, n, dim, generator=gen)
    g = -torch.rand(batch, heads, n, generator=gen)
    beta = torch.rand(batch, heads, n, generator=gen)
    o, final = _chunked_delta_rule(q, k, v, g, beta, torch.zeros(batch, heads, dim, dim))
    state, eye = torch.zeros(batch, heads, dim, dim), torch.eye(dim)
    for t in range(n):
        kt = k[:, :, t]
        state = g[:, :, t, None, None].exp() * (eye - beta[:, :, t, None, None] * kt[..., :, None] * kt[..., None, :]) \
            @ state + beta[:, :, t, None, None] * kt[..., :, None] * v[:, :, t, None, :]
        assert torch.allclose(o[:, :, t], torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]), atol=1e-12)
    assert torch.allclose(final, state, atol=1e-12)


def held_bytes(cache):
    """(bytes of each linear layer's state, bytes of each attention layer's keys and values), from the tensors."""
    layers = cache.layers
    return ([t.nbytes for t in layers if torch.is_tensor(t)],
            [sum(t.nbytes for t in layer) for layer in layers if not torch.is_tensor(layer)])


def formula(config, batch, tokens, element):
    """n_L B H d^2 4 + n_A 2 B H t d e."""
    n_attention = sum(config.is_attention(i) for i in range(config.n_layers))
    n_linear = config.n_layers - n_attention
    h, d = config.n_heads, config.head_dim
    return n_linear * batch * h * d * d * 4 + n_attention * 2 * batch * h * tokens * d * element


def test_worked_example_and_self_check():
    config = HybridConfig()
    assert (config.n_heads, config.head_dim, config.n_layers, config.attention_every) == (2, 32, 8, 4)
    assert sum(config.is_attention(i) for i in range(8)) == 2
    with torch.no_grad():
        model = stack(config, dtype=torch.float32)
        x = torch.randn(1, 101, config.d_model, dtype=torch.float32)
        _, cache = model.prefill(x[:, :100])
        states, keys_values = held_bytes(cache)
        assert states == [8192] * 6 and sum(states) == 49152 == formula(config, 1, 0, 4)
        assert sum(keys_values) == 102400 and cache_bytes(cache) == 151552 == formula(config, 1, 100, 4)
        _, cache = model.decode(x[:, 100:], cache)
        assert sum(map(sum, held_bytes(cache))) == cache_bytes(cache) == 151552 + 1024
        assert 1024 == formula(config, 1, 1, 4) - formula(config, 1, 0, 4)
    # An all-attention stack of eight layers: 4096 bytes a token; it needs less only while t < 16.
    everywhere = HybridConfig(attention_every=1)
    assert formula(everywhere, 1, 1, 4) == 4096 and formula(everywhere, 1, 0, 4) == 0
    crossing = [t for t in range(100) if formula(everywhere, 1, t, 4) < formula(config, 1, t, 4)]
    assert crossing == list(range(16))
    hybrid, full = formula(config, 1, 4096, 4), formula(everywhere, 1, 4096, 4)
    assert round(hybrid / 2 ** 20, 2) == 4.05 and full == 16 * 2 ** 20 and 0.25 < hybrid / full < 0.26
    # Self-check (1): bfloat16, B = 1, 100 tokens.
    with torch.no_grad():
        model = stack(config, dtype=torch.bfloat16)
        _, cache = model.prefill(x[:, :100].to(torch.bfloat16))
        states, keys_values = held_bytes(cache)
        assert (sum(states), sum(keys_values)) == (49152, 51200)
        assert cache_bytes(cache) == formula(config, 1, 100, 2) == 100352
        # Self-check (2): B = 2, a 10-token prompt, then one decode step, in bfloat16 (whose bytes the formula
        # counts too: float32 states, bfloat16 keys and values).
        model = stack(config, dtype=torch.bfloat16)
        x = torch.randn(2, 11, config.d_model).to(torch.bfloat16)
        _, cache = model.prefill(x[:, :10])
        assert cache_bytes(cache) == formula(config, 2, 10, 2)
        assert cache.layers[0].shape == (2, 2, 32, 32) and cache.layers[0].dtype == torch.float32
        assert all(t.shape == (2, 2, 10, 32) and t.dtype == torch.bfloat16 for t in cache.layers[3])
        _, cache = model.decode(x[:, 10:], cache)
        assert cache_bytes(cache) == formula(config, 2, 11, 2)
        assert all(t.shape == (2, 2, 11, 32) for t in cache.layers[3])
        assert cache.layers[0].shape == (2, 2, 32, 32)


SECTION = Path(__file__).resolve().parents[1] / "assignment/handout/sections/attention/hybrid.typ"


def test_the_section_prints_these_numbers():
    text = " ".join(SECTION.read_text().split())
    for printed in ("n_L dot B H d^2 dot 4 + n_A dot 2 B H t d dot e", "2 dot 32^2 dot 4 = 8192", "the six $49152$",
                    "2 dot 2 dot 2 dot 32 dot 4 = 1024", "49152 + 102400 = 151552", "4096 t < 49152 + 1024 t",
                    "$t < 16$", "$4.05$ MiB against 16 MiB", "2 dot 2 dot 2 dot 100 dot 32 dot 2 = 51200",
                    "$100352$", "$[2, 2, 32, 32]$", "$[2, 2, 10, 32]$", "$[2, 2, 11, 32]$", "$4 H d^2$",
                    "$2 H t d e$"):
        assert printed in text, printed
