"""The sliding-window section of the handout: its block ranges, its algorithms and every number it prints.

The section (assignment/handout/sections/attention/sliding_window.typ) derives which key blocks a query block visits
(first block f, unmasked range [u0, u1), end e) and which query blocks a key block's dK/dV program visits (first
block, unmasked range [v0, v1), end); here those formulas are written as the section writes them and compared, block
by block, with the visibility of every (query, key) pair. Algorithms 1 and 2 are run in float64, in blocks, and
compared with the reference's written-out oracle `sliding_window_attention_torch` and with autograd through it. The
tile counts (the work against causal attention), the worked example's ranges (T = 32, blocks of 4, w = 13, as in
the figure), the self-check's answers and those of the attention analysis self-check are recomputed.
"""

import math

import pytest
import torch

from reference.attention.mla import MLAConfig, MultiHeadLatentAttention
from reference.attention.sliding_window import sliding_window_attention_torch

pytestmark = pytest.mark.usefixtures("float64_by_default")


def cdiv(a, b):
    return -(-a // b)


def clamp(x, low, high):
    return min(max(x, low), high)


def key_range(m0, n, w, bm, bn):
    """(f, u0, u1, e) of query block [m0, m0 + bm), as the section writes them."""
    a = bn * (max(0, m0 - w + 1) // bn)
    e = min(m0 + bm, n)
    u0 = clamp(bn * cdiv(max(0, m0 + bm - w), bn), a, e)
    u1 = clamp(bn * (m0 // bn), u0, e)
    return a, u0, u1, e


def query_range(j0, n, w, bm, bn):
    """(f', v0, v1, e') of key block [j0, j0 + bn) in the dK/dV kernel, as the section writes them."""
    first = bm * (j0 // bm)
    end = min(j0 + bn + w - 1, n)
    v0 = clamp(bm * cdiv(j0 + bn - 1, bm), first, end)
    v1 = clamp(bm * (min(j0 + w, n) // bm), v0, end)
    return first, v0, v1, end


def visible(rows, cols, w):
    return (cols[None, :] <= rows[:, None]) & (cols[None, :] > rows[:, None] - w)


def pairs(i0, i1, j0, j1, n, w):
    """The visibility of the tile's in-range pairs."""
    rows, cols = torch.arange(i0, min(i1, n)), torch.arange(j0, min(j1, n))
    return visible(rows, cols, w)


CONFIGS = [(n, w, bm, bn) for n in (1, 37, 64) for w in (1, 5, 13, 16, 17, 200) for bm, bn in ((4, 4), (8, 4), (4, 8))]


@pytest.mark.parametrize("n,w,bm,bn", CONFIGS)
def test_block_ranges_match_the_pairs(n, w, bm, bn):
    """Forward: the blocks in [f, e) hold every visible key, those in [u0, u1) only visible pairs, the others none
    outside [f, e); backward: the same for the query blocks of a key block. Masked blocks that turn out whole are
    allowed only on a partial last block."""
    for m0 in range(0, n, bm):
        a, u0, u1, e = key_range(m0, n, w, bm, bn)
        assert a % bn == 0 and a <= u0 <= u1 <= e
        for j0 in range(0, n, bn):
            tile = pairs(m0, m0 + bm, j0, j0 + bn, n, w)
            if not a <= j0 < e:
                assert not tile.any()
            elif u0 <= j0 < u1:
                assert tile.all()
            elif m0 + bm <= n and j0 + bn <= n:
                assert not tile.all()  # masked: the window's lower edge or the diagonal
    for j0 in range(0, n, bn):
        first, v0, v1, end = query_range(j0, n, w, bm, bn)
        assert first <= v0 <= v1 <= end
        for i0 in range(0, n, bm):
            tile = pairs(i0, i0 + bm, j0, j0 + bn, n, w)
            if not first <= i0 < end:
                assert not tile.any()
            elif v0 <= i0 < v1:
                assert tile.all()
            elif i0 + bm <= n and j0 + bn <= n:
                assert not tile.all()


def algorithm_1(q, k, v, w, bm, bn):
    """The forward box: one program per query block, one loop over [f, e), the mask only outside [u0, u1)."""
    n, d = q.shape
    s = 1 / math.sqrt(d)
    o, L = torch.empty_like(q), torch.empty(n)
    for m0 in range(0, n, bm):
        rows = torch.arange(m0, min(m0 + bm, n))
        a, u0, u1, e = key_range(m0, n, w, bm, bn)
        m, ell, acc = torch.full((len(rows),), -math.inf), torch.zeros(len(rows)), torch.zeros(len(rows), d)
        for j0 in range(a, e, bn):
            cols = torch.arange(j0, min(j0 + bn, n))
            S = s * q[rows] @ k[cols].T
            if j0 < u0 or j0 >= u1:
                S = S.masked_fill(~visible(rows, cols, w), -math.inf)
            m_new = torch.maximum(m, S.amax(dim=1))
            shift = torch.where(m_new == -math.inf, 0.0, m_new)  # a row that sees no key yet: subtract 0
            P = torch.exp(S - shift[:, None])
            alpha = torch.exp(m - shift)
            ell = alpha * ell + P.sum(dim=1)
            acc = alpha[:, None] * acc + P @ v[cols]
            m = m_new
        o[rows], L[rows] = acc / ell[:, None], m + torch.log(ell)
    return o, L


def algorithm_2(q, k, v, o, L, dO, w, bm, bn):
    """The backward box: D = rowsum(dO * O); dK, dV per key block over [first, end); dQ per query block over the
    forward's [f, e); P = exp(S - L) masked outside the unmasked ranges."""
    n, d = q.shape
    s = 1 / math.sqrt(d)
    D = (dO * o).sum(dim=1)
    dQ, dK, dV = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for j0 in range(0, n, bn):
        cols = torch.arange(j0, min(j0 + bn, n))
        first, v0, v1, end = query_range(j0, n, w, bm, bn)
        for i0 in range(first, end, bm):
            rows = torch.arange(i0, min(i0 + bm, n))
            P = torch.exp(s * q[rows] @ k[cols].T - L[rows, None])
            if i0 < v0 or i0 >= v1:
                P = P * visible(rows, cols, w)
            dV[cols] += P.T @ dO[rows]
            dS = P * (dO[rows] @ v[cols].T - D[rows, None])
            dK[cols] += s * dS.T @ q[rows]
    for m0 in range(0, n, bm):
        rows = torch.arange(m0, min(m0 + bm, n))
        a, u0, u1, e = key_range(m0, n, w, bm, bn)
        for j0 in range(a, e, bn):
            cols = torch.arange(j0, min(j0 + bn, n))
            P = torch.exp(s * q[rows] @ k[cols].T - L[rows, None])
            if j0 < u0 or j0 >= u1:
                P = P * visible(rows, cols, w)
            dS = P * (dO[rows] @ v[cols].T - D[rows, None])
            dQ[rows] += s * dS @ k[cols]
    return dQ, dK, dV


@pytest.mark.parametrize("n,w,bm,bn", [(1, 1, 4, 4), (37, 1, 8, 4), (37, 5, 8, 4), (37, 13, 4, 8), (50, 17, 16, 8),
                                       (29, 29, 4, 4), (29, 60, 8, 8), (64, 16, 32, 16)])
def test_algorithms_match_the_oracle_and_autograd(n, w, bm, bn):
    gen = torch.Generator().manual_seed(n * 100 + w)
    q, k, v, dO = (torch.randn(n, 16, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o_ref, L_ref = sliding_window_attention_torch(q[None, None], k[None, None], v[None, None], w)
    grads = torch.autograd.grad(o_ref, (q, k, v), dO[None, None])
    with torch.no_grad():
        o, L = algorithm_1(q, k, v, w, bm, bn)
        got = algorithm_2(q, k, v, o, L, dO, w, bm, bn)
    torch.testing.assert_close(o, o_ref[0, 0].detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(L, L_ref[0, 0].detach(), rtol=1e-10, atol=1e-10)
    for g, want in zip(got, grads):
        torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-10)
    if w == 1:  # each query sees itself only: P = 1 and dS = 0, up to the rounding of exp(S - L)
        assert got[0].abs().max() < 1e-12 and got[1].abs().max() < 1e-12


def test_gradient_sums_run_over_the_band():
    """dV_j = sum_(i = j)^(j + w - 1) P_ij dO_i: the queries that see key j, against autograd."""
    n, w, d = 11, 3, 4
    gen = torch.Generator().manual_seed(3)
    q, k, v, dO = (torch.randn(n, d, generator=gen) for _ in range(4))
    v.requires_grad_()
    o, _ = sliding_window_attention_torch(q[None, None], k[None, None], v[None, None], w)
    (dv,) = torch.autograd.grad(o, v, dO[None, None])
    S = (q @ k.T / math.sqrt(d)).masked_fill(~visible(torch.arange(n), torch.arange(n), w), -math.inf)
    P = torch.softmax(S, dim=-1)
    for j in range(n):
        want = sum(P[i, j] * dO[i] for i in range(j, min(j + w, n)))
        torch.testing.assert_close(dv[j], want, rtol=1e-12, atol=1e-12)


def tiles(n, w, b):
    """(visited, masked) tiles of the forward over all query blocks, blocks of b queries and b keys."""
    visited = masked = 0
    for m0 in range(0, n, b):
        a, u0, u1, e = key_range(m0, n, w, b, b)
        blocks = range(a, e, b)
        visited += len(blocks)
        masked += sum(1 for j0 in blocks if j0 < u0 or j0 >= u1)
    return visited, masked


def test_work_against_causal_attention():
    # Per full query block: ceil((w - 1) / B) + 1 key blocks, against m0 / B + 1 for causal attention.
    for w, b in ((13, 4), (1024, 64), (256, 64), (9, 4), (1, 16), (100, 32)):
        m0 = 8 * max(w, b) // b * b
        a, _, _, e = key_range(m0, 10 * m0 + b, w, b, b)
        assert (e - a) // b == cdiv(w - 1, b) + 1
    # The reference's H200 shape: T = 32768, blocks of 64, w = 1024.
    n, w, b = 32768, 1024, 64
    visited, masked = tiles(n, w, b)
    causal = (n // b) * (n // b + 1) // 2
    assert (visited, causal) == (8568, 131328)
    assert causal / visited == pytest.approx(15.3, abs=0.05)
    a, _, _, e = key_range(n // 2, n, w, b, b)  # a query block away from the start
    assert (e - a) // b == 17
    assert masked == 2 * (n // b) - w // b  # the lower edge and the diagonal; the first w / B rows: the diagonal only


def test_worked_example():
    """T = 32, blocks of 4, w = 13 (the figure): query block 6 and key block 2."""
    n, w, b = 32, 13, 4
    assert key_range(24, n, w, b, b) == (12, 16, 24, 28)  # blocks 3 (masked), 4, 5 (whole), 6 (masked)
    assert query_range(8, n, w, b, b) == (8, 12, 20, 24)  # blocks 2 (masked), 3, 4 (whole), 5 (masked)
    visited, masked = tiles(n, w, b)
    assert (visited, masked, (n // b) * (n // b + 1) // 2) == (26, 13, 36)


def test_self_check_answers():
    # (1) T = 4096, B = 64, w = 256: tiles of the forward against causal.
    n, w, b = 4096, 256, 64
    visited, _ = tiles(n, w, b)
    causal = (n // b) * (n // b + 1) // 2
    assert (visited, causal) == (310, 2080)
    a, _, _, e = key_range(n // 2, n, w, b, b)
    assert (e - a) // b == 5
    assert causal / visited == pytest.approx(6.7, abs=0.05)
    # (2) The dK/dV program of key block 10 (keys 640 to 703): query blocks 10 to 14, 11 to 13 whole.
    first, v0, v1, end = query_range(640, n, w, b, b)
    assert (first, v0, v1, end) == (640, 704, 896, 959)
    assert [i0 // b for i0 in range(first, end, b)] == [10, 11, 12, 13, 14]
    assert [i0 // b for i0 in range(v0, v1, b)] == [11, 12, 13]


def capped_pairs(n, cap):
    """Query-key pairs when query t sees min(t + 1, cap) keys."""
    return sum(min(t + 1, cap) for t in range(n))


def test_attention_analysis_self_check_answers():
    """The analysis section's self-check (its questions on small sizes, not the graded ones)."""
    # (1) T = 8, w = 3: causal 36 pairs, the window 21.
    assert (capped_pairs(8, 8), capped_pairs(8, 3)) == (36, 21)
    assert 36 / 21 == pytest.approx(1.714, abs=5e-4)
    # (2) Top-3 of T = 8 (the sparse attention figure): the same 21 pairs, 21 / 36 of causal.
    assert 21 / 36 == pytest.approx(0.583, abs=5e-4)
    # (3) 16 heads of size 64, d_c = 128, d_rope = 32: values per token and layer, and bytes in bfloat16.
    latent = MultiHeadLatentAttention(MLAConfig(d_model=2, n_heads=16, head_dim=1, latent_dim=128, rope_dim=32))
    mla = latent.to(torch.bfloat16).cache_bytes_per_token()
    mha = sum(torch.empty(16, 64, dtype=torch.bfloat16, device="meta").nbytes for _ in ("keys", "values"))
    assert (mha // 2, mla // 2, mha, mla) == (2048, 160, 4096, 320)
    assert mha / mla == 12.8
