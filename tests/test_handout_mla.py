"""The multi-head latent attention section of the handout: every formula it prints, checked in float64.

On a float64 reference layer with random weights: the keys and values of every head are C times the up-projections
(rank at most d_c); RoPE's rotations compose as R_t^T R_s = R_(s-t) (so rotated keys cannot be absorbed); the
absorbed decode step of Algorithm 1, written here from the layer's weights (absorbed queries, scores against the
cached latents and rotary keys, latents mixed by the weights, then W_UV and W_O, or the precomputed W_O,i W_UV,i),
gives the reference forward's output at every position and the reference's own decode. The cost formulas are
compared with the shapes of the products they count, the worked example's and the self-check's printed numbers
are recomputed, and the section is checked to print them.
"""

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from grader.attention.test_mla import WORK_CASE, growth_budget
from reference.attention.mla import MLAConfig, MultiHeadLatentAttention, rope

pytestmark = pytest.mark.usefixtures("float64_by_default")

CONFIG = MLAConfig(d_model=12, n_heads=3, head_dim=4, latent_dim=5, rope_dim=6)


def layer(config=CONFIG, seed=0):
    torch.manual_seed(seed)
    module = MultiHeadLatentAttention(config).double()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0, 0.5)
    return module


def heads_of(weight, n_heads, head_dim):
    """[H * d_h, d_c] -> [H, d_h, d_c]: head i's rows of an up-projection."""
    return weight.view(n_heads, head_dim, -1)


def absorbed_step(module, h_t, latents, rope_keys, position, fold_output=False):
    """Algorithm 1 for one sequence: h_t [d_model], the cache [t, d_c] and [t, d_r] holding every token before it."""
    c = module.config
    latent = module.kv_down.weight @ h_t
    rope_key = rope((module.rope_key.weight @ h_t)[None], torch.tensor([position]))[0]
    latents, rope_keys = torch.cat([latents, latent[None]]), torch.cat([rope_keys, rope_key[None]])
    query = (module.query.weight @ h_t).view(c.n_heads, c.head_dim + c.rope_dim)
    q, q_rope = query[:, :c.head_dim], rope(query[:, c.head_dim:][:, None], torch.tensor([position]))[:, 0]
    key_up = heads_of(module.key_up.weight, c.n_heads, c.head_dim)
    value_up = heads_of(module.value_up.weight, c.n_heads, c.head_dim)
    q_latent = torch.einsum("hd,hdc->hc", q, key_up)  # q~_i = W_UK,i^T q_i, [H, d_c]
    scores = (q_latent @ latents.T + q_rope @ rope_keys.T) / math.sqrt(c.head_dim + c.rope_dim)
    weights = torch.softmax(scores, dim=-1)  # [H, t + 1]
    mixed = weights @ latents  # m_i = sum_s p_s c_s, [H, d_c]
    if fold_output:  # sum_i (W_O,i W_UV,i) m_i, the products precomputed
        out_heads = module.out.weight.view(c.d_model, c.n_heads, c.head_dim).permute(1, 0, 2)
        folded = out_heads @ value_up  # [H, d_model, d_c]
        return torch.einsum("hmc,hc->m", folded, mixed), latents, rope_keys
    heads = torch.einsum("hdc,hc->hd", value_up, mixed)  # o_i = W_UV,i m_i
    return module.out.weight @ heads.reshape(-1), latents, rope_keys


def test_keys_and_values_have_rank_at_most_the_latent_size():
    module = layer()
    h = torch.randn(1, 30, CONFIG.d_model)
    latents = module.kv_down(h)[0]  # C, [t, d_c]
    keys_and_values = torch.cat([module.key_up(latents), module.value_up(latents)], dim=1)  # [t, 2 H d_h]
    assert keys_and_values.shape == (30, 2 * CONFIG.n_heads * CONFIG.head_dim)
    assert torch.linalg.matrix_rank(keys_and_values) == CONFIG.latent_dim
    key_up = heads_of(module.key_up.weight, CONFIG.n_heads, CONFIG.head_dim)
    for i in range(CONFIG.n_heads):  # K_i = C (W_UK,i)^T
        assert torch.allclose(module.key_up(latents)[:, i * CONFIG.head_dim:(i + 1) * CONFIG.head_dim],
                              latents @ key_up[i].T, atol=1e-12)


def test_rope_rotations_compose_to_the_relative_position():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    for t, s in ((0, 0), (3, 7), (9, 2), (39, 40)):
        rotated = rope(x[None], torch.tensor([t]))[0] @ rope(y[None], torch.tensor([s]))[0]
        assert torch.allclose(rotated, x @ rope(y[None], torch.tensor([s - t]))[0], atol=1e-12)


@pytest.mark.parametrize("fold_output", [False, True])
def test_absorbed_decode_matches_the_forward(fold_output):
    module = layer(seed=2)
    h = torch.randn(2, 9, CONFIG.d_model, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = module(h)
        for b in range(2):
            latents, rope_keys = torch.zeros(0, CONFIG.latent_dim), torch.zeros(0, CONFIG.rope_dim)
            for t in range(9):
                out, latents, rope_keys = absorbed_step(module, h[b, t], latents, rope_keys, t, fold_output)
                assert torch.allclose(out, expected[b, t], atol=1e-12)
        # The reference's own decode agrees, and its cache is the one built here.
        _, cache = module.prefill(h[:, :5])
        for t in range(5, 9):
            out, cache = module.decode(h[:, t:t + 1], cache)
            assert torch.allclose(out[:, 0], expected[:, t], atol=1e-12)
        assert cache.length == 9
        assert torch.allclose(cache.latent[1, :9], latents, atol=1e-12)
        assert torch.allclose(cache.rope_key[1, :9], rope_keys, atol=1e-12)


def matmul_flops(function) -> int:
    """The floating-point operations of the matrix products `function` runs, as torch counts them."""
    with FlopCounterMode(display=False) as counter:
        function()
    return counter.get_total_flops()


def test_cost_formulas():
    """The section's FLOP counts of one decoding step, against torch's count of the products they stand for."""
    h, d_h, d_c, d_r, t = 8, 64, 8, 4, 99
    rows = t + 1
    q_latent, q_rope = torch.randn(h, d_c), torch.randn(h, d_r)
    latents, rope_keys = torch.randn(rows, d_c), torch.randn(rows, d_r)
    # Scores [H, t+1] from the latent and rotary parts, then mixing the latents.
    absorbed = matmul_flops(lambda: (q_latent @ latents.T + q_rope @ rope_keys.T).softmax(-1) @ latents)
    assert absorbed == 2 * rows * h * (2 * d_c + d_r)
    # Rebuilding every head's keys and values from the latents.
    key_up, value_up = torch.randn(h * d_h, d_c), torch.randn(h * d_h, d_c)
    assert matmul_flops(lambda: (latents @ key_up.T, latents @ value_up.T)) == 4 * rows * h * d_h * d_c
    # Absorbing one step's queries into latent space, head by head.
    queries, key_up_heads = torch.randn(h, 1, d_h), torch.randn(h, d_h, d_c)
    assert matmul_flops(lambda: torch.bmm(queries, key_up_heads)) == 2 * h * d_h * d_c


def test_cache_bytes_per_token_and_self_check():
    small = MLAConfig(d_model=2, n_heads=1, head_dim=1, latent_dim=512, rope_dim=64)
    module = MultiHeadLatentAttention(small).to(torch.bfloat16)
    assert module.cache_bytes_per_token() == 1152
    # Self-check (1): d_c = 256, d_r = 32 in bfloat16, 8 sequences of 4096 tokens.
    module = MultiHeadLatentAttention(MLAConfig(d_model=2, n_heads=1, head_dim=1, latent_dim=256, rope_dim=32))
    per_token = module.to(torch.bfloat16).cache_bytes_per_token()
    assert per_token == 576
    assert per_token * 4096 * 8 == 18874368
    # The grader's sizes: a step may build growth_budget elements per cached token (the grader's own function); every
    # head's keys, [B, H, t, d_h], are far more.
    case = replace(WORK_CASE, batch=1, n_heads=8, head_dim=64, latent_dim=8, rope_dim=4)
    assert growth_budget(case) * 1000 == 176000
    assert torch.empty(case.batch, case.n_heads, 1000, case.head_dim, device="meta").numel() == 512000


# The worked example as the section prints it: H = 2, d_h = d_c = d_r = 2, two cached latents, rotary query 0.
LATENTS = [[1.0, 0.0], [0.0, 2.0]]
KEY_UP = [[[1.0, 0.0], [1.0, 1.0]], [[0.0, 1.0], [2.0, 0.0]]]
VALUE_UP = [[[1.0, 1.0], [0.0, 1.0]], [[2.0, 0.0], [0.0, 1.0]]]
QUERIES = [[1.0, 1.0], [1.0, 0.0]]
PRINTED_KEYS = [[[1, 1], [0, 2]], [[0, 2], [2, 0]]]  # k_(s,i) for head i, token s
PRINTED_SCORES = [[2, 2], [0, 2]]
PRINTED_ABSORBED = [[2, 1], [0, 1]]
PRINTED_P = [[0.5, 0.5], [0.269, 0.731]]
PRINTED_M = [[0.5, 1], [0.269, 1.462]]
PRINTED_O = [[1.5, 1], [0.538, 1.462]]
PRINTED_V1 = [[1, 0], [2, 2]]


def test_worked_example():
    latents, key_up, value_up, q = (torch.tensor(x) for x in (LATENTS, KEY_UP, VALUE_UP, QUERIES))
    keys = torch.einsum("hdc,sc->hsd", key_up, latents)
    assert torch.equal(keys, torch.tensor(PRINTED_KEYS, dtype=torch.float64))
    naive_scores = torch.einsum("hd,hsd->hs", q, keys)
    assert torch.equal(naive_scores, torch.tensor(PRINTED_SCORES, dtype=torch.float64))
    absorbed = torch.einsum("hd,hdc->hc", q, key_up)
    assert torch.equal(absorbed, torch.tensor(PRINTED_ABSORBED, dtype=torch.float64))
    assert torch.equal(absorbed @ latents.T, naive_scores)
    scale = 1 / math.sqrt(2 + 2)
    assert scale == 0.5
    p = torch.softmax(absorbed @ latents.T * scale, dim=-1)
    assert torch.allclose(p, torch.tensor(PRINTED_P), atol=5e-4)
    assert round(math.e / (1 + math.e), 3) == 0.731
    m = p @ latents
    assert torch.allclose(m, torch.tensor(PRINTED_M), atol=5e-4)
    o = torch.einsum("hdc,hc->hd", value_up, m)
    assert torch.allclose(o, torch.tensor(PRINTED_O), atol=5e-4)
    values = torch.einsum("hdc,sc->hsd", value_up, latents)
    assert torch.equal(values[0], torch.tensor(PRINTED_V1, dtype=torch.float64))
    assert torch.allclose(torch.einsum("hs,hsd->hd", p, values), o, atol=1e-12)  # the naive path agrees
    # Numbers cached per token: d_c + d_r = 4 in the reference's cache, against 2 H d_h = 8 keys and values.
    example = MultiHeadLatentAttention(MLAConfig(d_model=2, n_heads=2, head_dim=2, latent_dim=2, rope_dim=2))
    assert example.cache_bytes_per_token() // torch.get_default_dtype().itemsize == 4
    assert 2 * torch.empty(2, 2, device="meta").numel() == 8


SECTION = Path(__file__).resolve().parents[1] / "assignment/handout/sections/attention/mla.typ"


def test_the_section_prints_these_numbers():
    text = " ".join(SECTION.read_text().split())
    for printed in ("c_1 = (1, 0)$, $c_2 = (0, 2)", "W^(U K)_1 = mat(1, 0; 1, 1)", "W^(U K)_2 = mat(0, 1; 2, 0)",
                    "W^(U V)_1 = mat(1, 1; 0, 1)", "W^(U V)_2 = mat(2, 0; 0, 1)", "q_1 = (1, 1)", "q_2 = (1, 0)",
                    "k_(1,1) = (1, 1)", "k_(2,1) = (0, 2)", "k_(1,2) = (0, 2)", "k_(2,2) = (2, 0)",
                    "tilde(q)_1 = (2, 1)", "tilde(q)_2 = (0, 1)",
                    "mat(2, 1; 0, 1) mat(1, 0; 0, 2) = mat(2, 2; 0, 2)", "P = mat(0.5, 0.5; 0.269, 0.731)",
                    "M = P C = mat(0.5, 1; 0.269, 1.462)", "o_1 = W^(U V)_1 m_1 = (1.5, 1)",
                    "o_2 = (0.538, 1.462)", "v_(1,1) = (1, 0)", "v_(2,1) = (2, 2)", "$d_c + d_r = 4$",
                    "(256 + 32) dot 2 = 576",
                    "576 dot 4096 dot 8 = 18874368", "(18 MiB)", "176000", "512000",
                    "2 (t + 1) H (2 d_c + d_r)", "4 (t + 1) H d_h d_c", "2 H d_h d_c"):
        assert printed in text, printed
