"""The DeepSeek sparse attention section of the handout: its formulas, its algorithm and every number it prints.

The section (assignment/handout/sections/attention/sparse_dsa.typ) writes the indexer's scores, the top-k rules, the
attention over the selected keys and its backward through the gather: dQ from the gathered rows, dK and dV as the
scatter (the transpose of the gather) of each query's [k, d] products, summed over the queries that selected a key.
Here the indexer and the top-k are written out by their rules and compared with the reference's
`indexer_scores_torch` and `select_topk` (plain torch); Algorithm 1 (a program per query, blocks of index slots, an
online softmax, then the backward with scatter-adds into zeroed buffers) runs in float64 and is compared with
autograd through the reference's oracle `sparse_attention_torch`. The worked example (T = 4, top 2, one head of size
1, as the backward figure draws it) and the self-check's answers are recomputed.
"""

import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from reference.attention.sparse_dsa import indexer_scores_torch, select_topk, sparse_attention_torch

pytestmark = pytest.mark.usefixtures("float64_by_default")


def indexer_by_the_formula(q_idx, k_idx, weights):
    """I[b, t, s] = sum_j w[b, t, j] relu(q_idx[b, t, j] . k_idx[b, s]) for s <= t, -inf for s > t."""
    batch, n, heads, _ = q_idx.shape
    scores = torch.full((batch, n, n), -math.inf)
    for b in range(batch):
        for t in range(n):
            for s in range(t + 1):
                scores[b, t, s] = sum(weights[b, t, j] * torch.relu(q_idx[b, t, j] @ k_idx[b, s]) for j in range(heads))
    return scores


def topk_by_the_rules(scores, k):
    """Candidates s <= t; highest score first, equal scores the lower key first; the row ascending, -1 padded."""
    batch, n, _ = scores.shape
    out = torch.full((batch, n, k), -1, dtype=torch.int64)
    for b in range(batch):
        for t in range(n):
            ranked = sorted(range(t + 1), key=lambda s: (-scores[b, t, s].item(), s))
            kept = sorted(ranked[:k])
            out[b, t, :len(kept)] = torch.tensor(kept, dtype=torch.int64)
    return out


def test_indexer_formula_matches_the_reference():
    gen = torch.Generator().manual_seed(0)
    q_idx, k_idx = torch.randn(2, 7, 3, 5, generator=gen), torch.randn(2, 7, 5, generator=gen)
    weights = torch.randn(2, 7, 3, generator=gen)  # of any sign
    want = indexer_scores_torch(q_idx, k_idx, weights)
    got = indexer_by_the_formula(q_idx, k_idx, weights)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.isinf(got).sum() == 2 * 7 * 6 // 2
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n,k", [(1, 1), (6, 1), (6, 3), (6, 6), (6, 9), (13, 4)])
def test_topk_rules_match_the_reference(n, k):
    gen = torch.Generator().manual_seed(n * 10 + k)
    scores = torch.randint(0, 3, (2, n, n), generator=gen).float()  # many ties
    scores = torch.where(torch.ones(n, n).triu(1).bool(), torch.randn(2, n, n, generator=gen).float(), scores)
    assert torch.equal(select_topk(scores, k), topk_by_the_rules(scores, k))
    assert torch.equal(select_topk(torch.zeros(1, n, n, dtype=torch.float32), k),
                       topk_by_the_rules(torch.zeros(1, n, n), k))  # all equal: the first min(k, t + 1) keys


def test_selection_is_a_step_function_of_the_scores():
    """Small changes of the scores leave the indices as they are: their derivative is zero where it exists."""
    gen = torch.Generator().manual_seed(1)
    scores = torch.randperm(64, generator=gen).float().reshape(1, 8, 8)  # distinct, gaps of at least 1
    noise = 0.1 * torch.rand(1, 8, 8, generator=gen).float()
    assert torch.equal(select_topk(scores, 3), select_topk(scores + noise, 3))


def algorithm_1(q, k, v, indices, dO, block=2):
    """Forward and backward, one program per query (all heads), slots in blocks; dK and dV by scatter-adds."""
    n, heads, d = q.shape
    s = 1 / math.sqrt(d)
    o, L = torch.empty_like(q), torch.empty(n, heads)
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)  # the buffers start at zero
    for t in range(n):
        m, ell, acc = torch.full((heads,), -1e30), torch.zeros(heads), torch.zeros(heads, d)
        for n0 in range(0, indices.shape[1], block):
            keys = indices[t, n0:n0 + block]
            valid = keys >= 0
            k_sel, v_sel = k[keys.clamp(min=0)] * valid[:, None], v[keys.clamp(min=0)] * valid[:, None]  # the gather
            S = (s * q[t] @ k_sel.T).masked_fill(~valid[None, :], -math.inf)
            m_new = torch.maximum(m, S.amax(dim=1))  # m starts finite: a block of -1 slots leaves it unchanged
            P = torch.exp(S - m_new[:, None])
            ell = torch.exp(m - m_new) * ell + P.sum(dim=1)
            acc = torch.exp(m - m_new)[:, None] * acc + P @ v_sel
            m = m_new
        o[t], L[t] = acc / ell[:, None], m + torch.log(ell)
    for t in range(n):
        D = (o[t] * dO[t]).sum(dim=1)  # one query's heads: no pre-pass needed
        grad_q = torch.zeros(heads, d)
        for n0 in range(0, indices.shape[1], block):
            keys = indices[t, n0:n0 + block]
            valid = keys >= 0
            k_sel, v_sel = k[keys.clamp(min=0)], v[keys.clamp(min=0)]
            P = torch.exp(s * q[t] @ k_sel.T - L[t][:, None]) * valid[None, :]
            dS = P * (dO[t] @ v_sel.T - D[:, None])
            grad_q += s * dS @ k_sel
            dk.index_add_(0, keys[valid], (s * dS.T @ q[t])[valid])  # the scatter: row n onto row keys[n]
            dv.index_add_(0, keys[valid], (P.T @ dO[t])[valid])
        dq[t] = grad_q
    return o, L, dq, dk, dv


class ScatterAdds(TorchDispatchMode):
    """Counts the elements (and their bytes) that index_add_ calls add, as torch dispatches them."""

    def __enter__(self):
        self.elements = self.bytes = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.index_add_.default, torch.ops.aten.index_add.default):
            source = args[3]
            self.elements += source.numel()
            self.bytes += source.numel() * source.element_size()
        return func(*args, **(kwargs or {}))


SECTION = Path(__file__).resolve().parents[1] / "assignment/handout/sections/attention/sparse_dsa.typ"


def random_selection(n, k, gen):
    """Distinct keys in any order, -1 in any slot, at least one key per row."""
    rows = []
    for _ in range(n):
        keys = torch.randperm(n, generator=gen)[:k]
        drop = torch.rand(k, generator=gen) < 0.3
        drop[torch.randint(0, k, (1,), generator=gen)] = False
        rows.append(torch.where(drop, -1, keys))
    return torch.stack(rows)


@pytest.mark.parametrize("n,heads,d,k,block", [(1, 1, 4, 1, 2), (9, 3, 8, 4, 2), (9, 2, 4, 5, 4), (12, 4, 8, 12, 8)])
def test_algorithm_matches_autograd_through_the_oracle(n, heads, d, k, block):
    gen = torch.Generator().manual_seed(n * 100 + k)
    q, dO = torch.randn(n, heads, d, generator=gen), torch.randn(n, heads, d, generator=gen)
    kk, v = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    indices = random_selection(n, k, gen)
    indices[0] = torch.cat([torch.tensor([-1] * (k - 1)), torch.tensor([3 % n])])  # -1 first, a key last
    q, kk, v = (t.requires_grad_() for t in (q, kk, v))
    o_ref, L_ref = sparse_attention_torch(q[None], kk[None], v[None], indices[None])
    grads = torch.autograd.grad(o_ref, (q, kk, v), dO[None])
    with torch.no_grad():
        o, L, dq, dk, dv = algorithm_1(q, kk, v, indices, dO, block)
    for got, want in [(o, o_ref[0]), (L, L_ref[0]), (dq, grads[0]), (dk, grads[1]), (dv, grads[2])]:
        torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-10)
    unselected = torch.ones(n, dtype=torch.bool)
    unselected[indices[indices >= 0]] = False
    assert (dk[unselected] == 0).all() and (dv[unselected] == 0).all()


def test_scatter_is_the_transpose_of_the_gather():
    """dV = sum_t G_t^T (P_t^T dO_t), with G_t the [k, T] matrix whose row n is the unit vector of key sigma_t(n)."""
    n, heads, d, k = 6, 3, 4, 3
    gen = torch.Generator().manual_seed(5)
    q, dO = torch.randn(n, heads, d, generator=gen), torch.randn(n, heads, d, generator=gen)
    kk, v = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    indices = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(n)])
    v.requires_grad_()
    o, L = sparse_attention_torch(q[None], kk[None], v[None], indices[None])
    (dv,) = torch.autograd.grad(o, v, dO[None])
    want = torch.zeros(n, d)
    for t in range(n):
        G = torch.eye(n)[indices[t]]  # [k, T]
        P = torch.exp(q[t] @ (G @ kk).T / math.sqrt(d) - L[0, t][:, None]).detach()  # [H, k]
        want += G.T @ (P.T @ dO[t])  # the sum over heads inside the product: k rows of d per query
    torch.testing.assert_close(dv, want, rtol=1e-12, atol=1e-12)


def test_worked_example():
    """T = 4, top 2; one head of size 1 (s = 1): q = (0, 0, ln 3, ln 3), k = (0, 0, 1, 1), v = (4, 0, 8, 2), dO = 1."""
    scores = torch.tensor([[5, 9, 9, 9], [2, 2, 9, 9], [1, 3, 3, 9], [4, 0, 4, 4]], dtype=torch.float32)[None]
    indices = select_topk(scores, 2)
    assert indices[0].tolist() == [[0, -1], [0, 1], [1, 2], [0, 2]]
    assert torch.equal(indices, topk_by_the_rules(scores, 2))
    ln3 = math.log(3)
    q = torch.tensor([0, 0, ln3, ln3]).reshape(1, 4, 1, 1).requires_grad_()
    k = torch.tensor([0.0, 0, 1, 1]).reshape(1, 4, 1).requires_grad_()
    v = torch.tensor([4.0, 0, 8, 2]).reshape(1, 4, 1).requires_grad_()
    o, L = sparse_attention_torch(q, k, v, indices)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
    close = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(L.flatten(), torch.tensor([0, math.log(2), math.log(4), math.log(4)]), **close)
    torch.testing.assert_close(o.flatten(), torch.tensor([4.0, 2, 6, 7]), **close)
    torch.testing.assert_close(dv.flatten(), torch.tensor([1.75, 0.75, 1.5, 0]), **close)
    torch.testing.assert_close(dk.flatten(), torch.tensor([-0.75, -1.5, 2.25, 0]) * ln3, **close)
    torch.testing.assert_close(dq.flatten(), torch.tensor([0, 0, 1.5, 0.75]), **close)
    # The probabilities and dS printed per query: P = (1), (1/2, 1/2), (1/4, 3/4), (1/4, 3/4).
    P = [[1.0], [0.5, 0.5], [0.25, 0.75], [0.25, 0.75]]
    rows = [[0], [0, 1], [1, 2], [0, 2]]
    vv, oo = [4, 0, 8, 2], [4, 2, 6, 7]
    dS = [[p * (vv[s] - oo[t]) for p, s in zip(P[t], rows[t])] for t in range(4)]
    assert dS == [[0.0], [1.0, -1.0], [-1.5, 1.5], [-0.75, 0.75]]
    got = algorithm_1(q[0].detach(), k[0].detach(), v[0].detach(), indices[0], torch.ones(4, 1, 1), block=1)
    torch.testing.assert_close(got[3].flatten(), dk.flatten(), **close)
    assert math.log(3) == pytest.approx(1.0986, abs=1e-4)


def test_self_check_answers():
    # (1) Atomic additions per query, k = 2048, d = 128: one program of 64 heads, or four of 16.
    # Counted on Algorithm 1 for one query whose slots all hold keys: the elements its scatter-adds add, linear in
    # the slots, so counted for 256 of them and scaled to k = 2048.
    k, d, heads, slots = 2048, 128, 64, 256
    gen = torch.Generator().manual_seed(0)
    f32 = dict(generator=gen, dtype=torch.float32)  # the kernel's dK and dV buffers
    q, dO = torch.randn(1, heads, d, **f32), torch.randn(1, heads, d, **f32)
    keys, values = torch.randn(slots, d, **f32), torch.randn(slots, d, **f32)
    indices = torch.randperm(slots, generator=gen)[None]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with ScatterAdds() as one:
            algorithm_1(q, keys, values, indices, dO, block=slots)
        with ScatterAdds() as four:
            for group in range(4):
                heads_of = slice(16 * group, 16 * (group + 1))
                algorithm_1(q[:, heads_of], keys, values, indices, dO[:, heads_of], block=slots)
    finally:
        torch.set_default_dtype(previous)
    scale = k // slots
    assert one.elements * scale == 524288 and one.bytes * scale == 2 * 2**20  # 2 MiB of float32 added per query
    assert four.elements * scale == 2097152
    # (2) T = 8192, top 2048: the rows with a -1 (queries 0 to 2046), and their -1 slots. On the reference, query t
    # holds max(k - (t + 1), 0) slots of -1 (checked on a small case); summed over the 8192 queries.
    small = select_topk(torch.randn(1, 12, 12, **f32), 5)[0]
    holes = lambda t, k: max(k - (t + 1), 0)
    assert (small == -1).sum(1).tolist() == [holes(t, 5) for t in range(12)]
    assert sum(holes(t, k) > 0 for t in range(8192)) == 2047 and sum(holes(t, k) for t in range(8192)) == 2096128
    text = " ".join(SECTION.read_text().split())
    for printed in ("$2 k d = 524288$ (2 MiB of float32", "programs of 16 heads each adds its own rows: $2097152$",
                    "queries 0 to 2046, 2047 rows", "$2047 dot 2048 \\/ 2 = 2096128$ in all"):
        assert printed in text, printed
