"""The formulas of the Mamba-2 handout section (assignment/handout/sections/attention/mamba2.typ), checked.

Each function below writes a formula of the section as the section writes it, in float64, one (batch, head) at a
time: the chunked forward, the state gradient carried backwards over the chunks, dq, dk, dv, the non-cancelling dg
and the worked example's numbers. They are compared with the plain recurrence, with autograd through it, and with
the reference's recurrent form. CPU only, a fraction of a second.
"""

import math
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.usefixtures("float64_by_default")


# ---------------------------------------------------------------------------------------------------------------
# The recurrence, one token at a time: S_t = e^(g_t) S_(t-1) + k_t v_t^T, o_t = S_t^T q_t.


def recurrent(q, k, v, g, s0):
    state, outputs = s0, []
    for t in range(q.shape[0]):
        state = torch.exp(g[t]) * state + torch.outer(k[t], v[t])
        outputs.append(state.T @ q[t])
    return torch.stack(outputs), state


# ---------------------------------------------------------------------------------------------------------------
# The chunked forms as the section writes them.


def chunk_decays(g_c):
    """b (the cumulative log-decay inside the chunk), b_C (its last entry) and Gamma_ij = e^(b_i - b_j), j <= i,
    masked before exponentiating."""
    b = torch.cumsum(g_c, 0)
    n = b.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    diff = torch.where(causal, b[:, None] - b[None, :], torch.full((n, n), -math.inf, dtype=b.dtype))
    return b, b[-1], torch.exp(diff)


def chunked_forward(q, k, v, g, s0, chunk):
    """O_c = diag(e^b) Q S + (Q K^T (.) Gamma) V;  S <- e^(b_C) S + (e^(b_C - b) (.) K)^T V. Returns o, the final
    state and the state entering each chunk."""
    state, outputs, entering = s0, [], []
    for start in range(0, q.shape[0], chunk):
        rows = slice(start, start + chunk)
        Q, K, V = q[rows], k[rows], v[rows]
        b, b_last, gamma = chunk_decays(g[rows])
        entering.append(state)
        outputs.append(torch.exp(b)[:, None] * (Q @ state) + ((Q @ K.T) * gamma) @ V)
        state = torch.exp(b_last) * state + (torch.exp(b_last - b)[:, None] * K).T @ V
    return torch.cat(outputs), state, entering


def chunked_backward(q, k, v, g, entering, d_o, d_final, chunk):
    """The backward of the section: dS carried backwards, dS <- e^(b_C) dS' + (diag(e^b) Q)^T dO, and per chunk
        dQ = diag(e^b) dO S^T + (dO V^T (.) Gamma) K
        dK = diag(e^(b_C - b)) V dS'^T + (dO V^T (.) Gamma)^T Q
        dV = diag(e^(b_C - b)) K dS' + (Q K^T (.) Gamma)^T dO
        dg_t = sum_(i >= t) e^(b_i) q_i^T S dO_i + sum_(i >= t) sum_(j < t) e^(b_i - b_j) (q_i.k_j)(dO_i.v_j)
               + e^(b_C) <dS', S> + sum_(j < t) e^(b_C - b_j) k_j^T dS' v_j."""
    dq, dk, dv, dg = (torch.zeros_like(x) for x in (q, k, v, g))
    d_next = d_final
    starts = list(range(0, q.shape[0], chunk))
    for index in reversed(range(len(starts))):
        rows = slice(starts[index], starts[index] + chunk)
        Q, K, V, dO, S = q[rows], k[rows], v[rows], d_o[rows], entering[index]
        b, b_last, gamma = chunk_decays(g[rows])
        n = b.shape[0]
        grad_scores = (dO @ V.T) * gamma
        dq[rows] = torch.exp(b)[:, None] * (dO @ S.T) + grad_scores @ K
        dk[rows] = torch.exp(b_last - b)[:, None] * (V @ d_next.T) + grad_scores.T @ Q
        dv[rows] = torch.exp(b_last - b)[:, None] * (K @ d_next) + ((Q @ K.T) * gamma).T @ dO

        inter = torch.exp(b) * torch.einsum("ik,kv,iv->i", Q, S, dO)
        first = torch.flip(torch.cumsum(torch.flip(inter, [0]), 0), [0])  # sum over i >= t
        pairs = (Q @ K.T) * (dO @ V.T) * gamma  # [i, j]
        i, j, t = torch.arange(n)[:, None, None], torch.arange(n)[None, :, None], torch.arange(n)[None, None, :]
        second = (pairs[:, :, None] * ((i >= t) & (j < t))).sum((0, 1))
        third = torch.exp(b_last) * (d_next * S).sum()
        key_terms = torch.exp(b_last - b) * torch.einsum("jk,kv,jv->j", K, d_next, V)
        fourth = torch.cat([key_terms.new_zeros(1), torch.cumsum(key_terms, 0)[:-1]])  # sum over j < t
        dg[rows] = first + second + third + fourth

        d_next = torch.exp(b_last) * d_next + (torch.exp(b)[:, None] * Q).T @ dO
    return dq, dk, dv, dg, d_next


def random_problem(seed, T=11, K=3, V=4, decay=1.0):
    generator = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, K, generator=generator), torch.randn(T, K, generator=generator)
    v = torch.randn(T, V, generator=generator)
    g = -decay * torch.rand(T, generator=generator)
    s0 = torch.randn(K, V, generator=generator)
    d_o, d_final = torch.randn(T, V, generator=generator), torch.randn(K, V, generator=generator)
    return q, k, v, g, s0, d_o, d_final


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 11, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_forward_matches_the_recurrence(seed, chunk):
    q, k, v, g, s0, _, _ = random_problem(seed, decay=2.0)
    o, final = recurrent(q, k, v, g, s0)
    o_chunked, final_chunked, _ = chunked_forward(q, k, v, g, s0, chunk)
    torch.testing.assert_close(o_chunked, o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final_chunked, final, rtol=1e-12, atol=1e-12)


def test_the_unrolled_state_inside_a_chunk():
    # S_i = e^(b_i) S + sum_(j <= i) e^(b_i - b_j) k_j v_j^T, the identity the derivation unrolls to.
    q, k, v, g, s0, _, _ = random_problem(2, T=5)
    b = torch.cumsum(g, 0)
    state = s0
    for i in range(5):
        state = torch.exp(g[i]) * state + torch.outer(k[i], v[i])
        unrolled = torch.exp(b[i]) * s0 + sum(torch.exp(b[i] - b[j]) * torch.outer(k[j], v[j]) for j in range(i + 1))
        torch.testing.assert_close(unrolled, state, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 3, 4, 11])
@pytest.mark.parametrize("with_initial", [True, False])
def test_chunked_backward_matches_autograd_of_the_recurrence(chunk, with_initial):
    q, k, v, g, s0, d_o, d_final = random_problem(3, decay=2.0)
    if not with_initial:
        s0 = torch.zeros_like(s0)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, s0)]
    o, final = recurrent(*leaves)
    expected = torch.autograd.grad((o * d_o).sum() + (final * d_final).sum(), leaves)
    _, _, entering = chunked_forward(q, k, v, g, s0, chunk)
    got = chunked_backward(q, k, v, g, entering, d_o, d_final, chunk)
    for name, a, e in zip(("dq", "dk", "dv", "dg", "dS0"), got, expected):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=name)


def naive_dg(q, k, v, g, s0, d_o, d_final, dtype):
    """dg_t = sum_(s >= t) (q_s . dq_s - k_s . dk_s) + <dS_T, S_T>, from the whole-sequence gradients."""
    leaves = [x.to(dtype).clone().requires_grad_() for x in (q, k, v, g, s0)]
    o, final = recurrent(*leaves)
    dq, dk = torch.autograd.grad((o * d_o.to(dtype)).sum() + (final * d_final.to(dtype)).sum(), leaves[:2])
    per_token = (leaves[0] * dq).sum(1) - (leaves[1] * dk).sum(1)
    per_token[-1] = per_token[-1] + (d_final.to(dtype) * final).sum()
    return torch.flip(torch.cumsum(torch.flip(per_token, [0]), 0), [0]).detach()


def test_the_naive_dg_is_exact_in_algebra_but_cancels_in_float32():
    q, k, v, g, _, d_o, d_final = random_problem(4, decay=12.0)
    s0 = torch.zeros(q.shape[1], v.shape[1])  # no initial state: dg_1 is exactly 0
    _, _, entering = chunked_forward(q, k, v, g, s0, 4)
    dg = chunked_backward(q, k, v, g, entering, d_o, d_final, 4)[3]
    torch.testing.assert_close(naive_dg(q, k, v, g, s0, d_o, d_final, torch.float64), dg, rtol=1e-9, atol=1e-9)
    assert dg[0] == 0
    # In float32 the section's form stays 0 at the first token, the naive one is left with rounding.
    _, _, entering32 = chunked_forward(*(x.float() for x in (q, k, v, g, s0)), 4)
    dg32 = chunked_backward(*(x.float() for x in (q, k, v, g)), entering32, d_o.float(), d_final.float(), 4)[3]
    assert dg32[0] == 0
    assert naive_dg(q, k, v, g, s0, d_o, d_final, torch.float32)[0] != 0


def test_matches_the_reference_recurrent_form():
    reference = pytest.importorskip("reference.attention.mamba2")
    generator = torch.Generator().manual_seed(5)
    B, H, T, K, V = 2, 2, 9, 16, 32  # the reference's checks want K, V in (16, 32, 64, 128)
    q, k = torch.randn(B, H, T, K, generator=generator), torch.randn(B, H, T, K, generator=generator)
    v = torch.randn(B, H, T, V, generator=generator)
    g = -torch.rand(B, H, T, generator=generator)
    s0 = torch.randn(B, H, K, V, generator=generator)
    o_ref, final_ref = reference.mamba2_recurrent(*(x.float() for x in (q, k, v, g, s0)))
    for b in range(B):
        for h in range(H):
            o, final, _ = chunked_forward(q[b, h], k[b, h], v[b, h], g[b, h], s0[b, h], 4)
            torch.testing.assert_close(o.float(), o_ref[b, h], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(final.float(), final_ref[b, h], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# The worked example: T = 4, K = V = 1, chunks of C = 2, S_0 = 4, the loss L = sum_t o_t.

EXAMPLE = dict(
    q=[1.0, 2.0, 1.0, 1.0], k=[1.0, 1.0, 2.0, 1.0], v=[2.0, 4.0, 1.0, 2.0],
    g=[math.log(0.5), math.log(0.5), 0.0, math.log(0.5)], s0=4.0,
)
# The numbers the section prints.
PRINTED = dict(
    states=[4.0, 4.0, 6.0, 8.0, 6.0],  # S_0 .. S_4 from the recurrence
    o=[4.0, 12.0, 8.0, 6.0],
    inter=[2.0, 2.0, 6.0, 3.0],  # diag(e^b) Q S per chunk
    intra=[2.0, 10.0, 2.0, 3.0],  # (Q K^T (.) Gamma) V per chunk
    chunk_states=[4.0, 6.0, 6.0],  # the state entering chunk 1, entering chunk 2, final
    state_terms=[1.0, 5.0, 3.0, 3.0],  # e^(b_C) S and (e^(b_C - b) (.) K)^T V, chunk 1 then chunk 2
    gamma=[[1.0, 0.0], [0.5, 1.0]],  # both chunks: Gamma of chunk 1 (b = ln 1/2, ln 1/4) and of chunk 2 (0, ln 1/2)
    d_states=[1.375, 1.5, 0.0],  # dS entering chunk 1 (= dS_0), entering chunk 2, final
    dg=[5.5, 7.0, 9.0, 4.0],
)


def example_tensors():
    q, k, v = (torch.tensor(EXAMPLE[name])[:, None] for name in ("q", "k", "v"))
    return q, k, v, torch.tensor(EXAMPLE["g"]), torch.tensor([[EXAMPLE["s0"]]])


def test_worked_example_by_the_recurrence():
    q, k, v, g, s0 = example_tensors()
    state, states = s0, [s0.item()]
    for t in range(4):
        state = torch.exp(g[t]) * state + torch.outer(k[t], v[t])
        states.append(state.item())
    assert states == pytest.approx(PRINTED["states"], abs=1e-12)
    o, final = recurrent(q, k, v, g, s0)
    assert o.flatten().tolist() == pytest.approx(PRINTED["o"], abs=1e-12)
    assert final.item() == pytest.approx(PRINTED["chunk_states"][-1], abs=1e-12)


def test_worked_example_by_the_chunked_formulas():
    q, k, v, g, s0 = example_tensors()
    o, final, entering = chunked_forward(q, k, v, g, s0, 2)
    assert o.flatten().tolist() == pytest.approx(PRINTED["o"], abs=1e-12)
    assert [s.item() for s in entering] + [final.item()] == pytest.approx(PRINTED["chunk_states"], abs=1e-12)
    inter, intra, state_terms = [], [], []
    for c, start in enumerate((0, 2)):
        rows = slice(start, start + 2)
        b, b_last, gamma = chunk_decays(g[rows])
        assert gamma.flatten().tolist() == pytest.approx(sum(PRINTED["gamma"], []), abs=1e-12)
        inter += (torch.exp(b)[:, None] * (q[rows] @ entering[c])).flatten().tolist()
        intra += (((q[rows] @ k[rows].T) * gamma) @ v[rows]).flatten().tolist()
        state_terms += [(torch.exp(b_last) * entering[c]).item(),
                        ((torch.exp(b_last - b)[:, None] * k[rows]).T @ v[rows]).item()]
    assert inter == pytest.approx(PRINTED["inter"], abs=1e-12)
    assert intra == pytest.approx(PRINTED["intra"], abs=1e-12)
    assert state_terms == pytest.approx(PRINTED["state_terms"], abs=1e-12)


def test_worked_example_backward():
    q, k, v, g, s0 = example_tensors()
    d_o, d_final = torch.ones(4, 1), torch.zeros(1, 1)
    _, _, entering = chunked_forward(q, k, v, g, s0, 2)
    _, _, _, dg, d_s0 = chunked_backward(q, k, v, g, entering, d_o, d_final, 2)
    assert dg.tolist() == pytest.approx(PRINTED["dg"], abs=1e-12)
    assert d_s0.item() == pytest.approx(PRINTED["d_states"][0], abs=1e-12)
    # dS entering chunk 2 = e^(b_C) dS' + sum_i e^(b_i) q_i dO_i over chunk 2, dS' = 0
    b = torch.cumsum(g[2:], 0)
    assert (torch.exp(b) * q[2:, 0]).sum().item() == pytest.approx(PRINTED["d_states"][1], abs=1e-12)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, s0)]
    o, _ = recurrent(*leaves)
    grads = torch.autograd.grad(o.sum(), leaves)
    assert grads[3].tolist() == pytest.approx(PRINTED["dg"], abs=1e-12)
    assert grads[4].item() == pytest.approx(PRINTED["d_states"][0], abs=1e-12)


def test_self_check_answers():
    # One chunk-boundary state, K = V = 64, in float32: 16 KiB, as torch sizes it.
    assert torch.empty(64, 64, dtype=torch.float32, device="meta").nbytes == 16384
    section = Path(__file__).resolve().parents[1] / "assignment/handout/sections/attention/mamba2.typ"
    assert "$64 dot 64 dot 4 = 16384$ bytes, 16 KiB" in " ".join(section.read_text().split())
    # g = 0: Gamma is the causal mask and the state update is S + K^T V, linear attention with phi = identity.
    q, k, v, _, s0, _, _ = random_problem(6)
    zero = torch.zeros(q.shape[0])
    o, final, _ = chunked_forward(q, k, v, zero, s0, 4)
    mask = torch.ones(q.shape[0], q.shape[0]).tril()
    torch.testing.assert_close(o, q @ s0 + ((q @ k.T) * mask) @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, s0 + k.T @ v, rtol=1e-12, atol=1e-12)
