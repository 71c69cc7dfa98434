"""The Gated DeltaNet section of the handout: every formula it prints, checked in float64.

The chunked forward (A, the forward substitution, U, W, the output and the state update), the backward's recurrence
of dS over chunks and the per-chunk gradients are implemented here exactly as the section writes them, one chunk at
a time for one head, and compared with the plain recurrence (and its autograd) on random inputs with several chunks,
a short last chunk and an initial state; the plain recurrence is compared with the reference's own
`gated_deltanet_recurrent`. The worked example's printed numbers are hard-coded as the section prints them and
recomputed both ways.
"""

import math
from pathlib import Path

import pytest
import torch

from reference.attention.gated_deltanet import gated_deltanet_recurrent

pytestmark = pytest.mark.usefixtures("float64_by_default")


def recurrence(q, k, v, g, beta, state):
    """S_t = e^(g_t) (I - beta_t k_t k_t^T) S_(t-1) + beta_t k_t v_t^T, o_t = S_t^T q_t; one head, [T, K] and [T, V]."""
    eye = torch.eye(k.shape[1])
    outputs = []
    for t in range(q.shape[0]):
        state = g[t].exp() * (eye - beta[t] * torch.outer(k[t], k[t])) @ state + beta[t] * torch.outer(k[t], v[t])
        outputs.append(state.T @ q[t])
    return torch.stack(outputs), state


def chunks(n, size):
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def chunk_terms(k, v, g, beta):
    """One chunk: b, Gamma (j <= i), A, T = (I + A)^-1 by forward substitution, U and W, as the section writes them."""
    c = k.shape[0]
    b = torch.cumsum(g, 0)
    below_or_on = torch.ones(c, c).tril().bool()
    strictly = torch.ones(c, c).tril(-1).bool()
    diff = (b[:, None] - b[None, :]).masked_fill(~below_or_on, -math.inf)  # masked before exp
    gamma = diff.exp()
    a = beta[:, None] * (k @ k.T) * gamma * strictly  # A_ij = beta_i e^(b_i - b_j) k_i^T k_j, j < i
    rows = []
    for i in range(c):  # T_i = e_i - sum_(j < i) A_ij T_j
        row = torch.eye(c)[i].clone()
        for j in range(i):
            row = row - a[i, j] * rows[j]
        rows.append(row)
    inverse = torch.stack(rows)
    x_u = beta[:, None] * v
    x_w = (beta * b.exp())[:, None] * k
    return b, gamma, a, inverse, x_u, x_w


def chunked_forward(q, k, v, g, beta, state, size):
    """O_c = diag(e^b) Q S + (Q K^T . Gamma)(U - W S), S <- e^(b_C) S + (e^(b_C - b) . K)^T (U - W S)."""
    outputs, states = [], []
    for s in chunks(q.shape[0], size):
        b, gamma, a, inverse, x_u, x_w = chunk_terms(k[s], v[s], g[s], beta[s])
        assert torch.allclose(inverse @ (torch.eye(len(b)) + a), torch.eye(len(b)), atol=1e-12)
        u, w = inverse @ x_u, inverse @ x_w
        new = u - w @ state
        outputs.append(b.exp()[:, None] * (q[s] @ state) + ((q[s] @ k[s].T) * gamma) @ new)
        states.append(state)
        state = b[-1].exp() * state + ((b[-1] - b).exp()[:, None] * k[s]).T @ new
    return torch.cat(outputs), state, states


def chunked_backward(q, k, v, g, beta, states, grad_o, grad_final, size):
    """dS before a chunk from dS after it, and each chunk's dq, dk, dv, dbeta, and db (dg's per-chunk pieces)."""
    parts = chunks(q.shape[0], size)
    dq, dk, dv, dbeta, dg = (torch.zeros_like(x) for x in (q, k, v, beta, g))
    grad_state = grad_final
    grad_states = [None] * len(parts)
    for c in reversed(range(len(parts))):
        s, state, after = parts[c], states[c], grad_state
        qc, kc, vc, bc, do = q[s], k[s], v[s], beta[s], grad_o[s]
        b, gamma, a, inverse, x_u, x_w = chunk_terms(kc, vc, g[s], bc)
        u, w = inverse @ x_u, inverse @ x_w
        new = u - w @ state
        tail = (b[-1] - b).exp()[:, None] * kc
        d_new = ((qc @ kc.T) * gamma).T @ do + tail @ after
        grad_state = b[-1].exp() * after + (b.exp()[:, None] * qc).T @ do - w.T @ d_new
        grad_states[c] = after
        dq[s] = b.exp()[:, None] * (do @ state.T) + ((do @ new.T) * gamma) @ kc
        d_u, d_w = d_new, -d_new @ state.T
        d_xu, d_xw = inverse.T @ d_u, inverse.T @ d_w
        d_inverse = d_u @ x_u.T + d_w @ x_w.T
        d_a = (-inverse.T @ d_inverse @ inverse.T).tril(-1)
        strict_gamma = gamma.tril(-1)
        dv[s] = bc[:, None] * d_xu
        dbeta[s] = (vc * d_xu).sum(1) + b.exp() * (kc * d_xw).sum(1) + (d_a * (kc @ kc.T) * strict_gamma).sum(1)
        d = bc[:, None] * d_a * strict_gamma
        dk[s] = ((do @ new.T) * gamma).T @ qc + (b[-1] - b).exp()[:, None] * (new @ after.T) \
            + (bc * b.exp())[:, None] * d_xw + (d + d.T) @ kc
        # dg_t = sum over i >= t in the chunk of dL/db_i, db from autograd through the chunk's formulas.
        leaf = b.detach().requires_grad_()
        loss = chunk_loss(qc, kc, vc, bc, leaf, state, do, after)
        (d_b,) = torch.autograd.grad(loss, leaf)
        dg[s] = torch.flip(torch.cumsum(torch.flip(d_b, [0]), 0), [0])
    return grad_state, grad_states, dq, dk, dv, dbeta, dg


def chunk_loss(q, k, v, beta, b, state, grad_o, grad_after):
    """<dO, O_c> + <dS', S'> for one chunk, as a function of its cumulative log-decay b (the section's formulas)."""
    c = len(b)
    diff = (b[:, None] - b[None, :]).masked_fill(~torch.ones(c, c).tril().bool(), -math.inf)
    gamma = diff.exp()
    a = beta[:, None] * (k @ k.T) * gamma.tril(-1)
    inverse = torch.linalg.inv(torch.eye(c) + a)
    new = inverse @ (beta[:, None] * v) - inverse @ ((beta * b.exp())[:, None] * k) @ state
    o = b.exp()[:, None] * (q @ state) + ((q @ k.T) * gamma) @ new
    after = b[-1].exp() * state + ((b[-1] - b).exp()[:, None] * k).T @ new
    return (o * grad_o).sum() + (after * grad_after).sum()


def random_inputs(seed, n=50, key_dim=4, value_dim=3, zero_decay=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, key_dim, generator=gen) / key_dim ** 0.5
    k = torch.nn.functional.normalize(torch.randn(n, key_dim, generator=gen), dim=-1)
    v = torch.randn(n, value_dim, generator=gen)
    g = torch.zeros(n) if zero_decay else -torch.rand(n, generator=gen) * 1.5
    beta = torch.rand(n, generator=gen) * 0.98 + 0.01
    state = torch.randn(key_dim, value_dim, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("size", [4, 16])
@pytest.mark.parametrize("zero_decay", [False, True])
def test_chunked_forward_matches_the_recurrence(size, zero_decay):
    q, k, v, g, beta, state = random_inputs(0, zero_decay=zero_decay)
    o_ref, final_ref = recurrence(q, k, v, g, beta, state)
    o, final, _ = chunked_forward(q, k, v, g, beta, state, size)
    assert torch.allclose(o, o_ref, atol=1e-10) and torch.allclose(final, final_ref, atol=1e-10)


def test_recurrence_matches_the_reference_recurrent_form():
    batch, heads, n, key_dim, value_dim = 2, 2, 40, 16, 16
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, heads, n, key_dim, generator=gen) / key_dim ** 0.5
    k = torch.nn.functional.normalize(torch.randn(batch, heads, n, key_dim, generator=gen), dim=-1)
    v = torch.randn(batch, heads, n, value_dim, generator=gen)
    g = -torch.rand(batch, heads, n, generator=gen)
    beta = torch.rand(batch, heads, n, generator=gen)
    state = torch.randn(batch, heads, key_dim, value_dim, generator=gen)
    o_ref, final_ref = gated_deltanet_recurrent(*(x.float() for x in (q, k, v, g, beta, state)))
    for bh in range(batch * heads):
        i, h = divmod(bh, heads)
        o, final, _ = chunked_forward(q[i, h], k[i, h], v[i, h], g[i, h], beta[i, h], state[i, h], 16)
        assert torch.allclose(o, o_ref[i, h].double(), atol=1e-4)
        assert torch.allclose(final, final_ref[i, h].double(), atol=1e-4)


def test_chunked_backward_matches_autograd_of_the_recurrence():
    size = 16
    q, k, v, g, beta, state = random_inputs(2)
    n = q.shape[0]
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, state)]
    # A zero added to the state at each chunk boundary: its gradient is dS there.
    probes = [torch.zeros_like(state, requires_grad=True) for _ in chunks(n, size)]
    lq, lk, lv, lg, lbeta, lstate = leaves
    eye, outputs, current = torch.eye(k.shape[1]), [], lstate
    for c, s in enumerate(chunks(n, size)):
        current = current + probes[c]
        for t in range(s.start, s.stop):
            current = lg[t].exp() * (eye - lbeta[t] * torch.outer(lk[t], lk[t])) @ current \
                + lbeta[t] * torch.outer(lk[t], lv[t])
            outputs.append(current.T @ lq[t])
    gen = torch.Generator().manual_seed(3)
    grad_o, grad_final = torch.randn(n, v.shape[1], generator=gen), torch.randn(*state.shape, generator=gen)
    torch.autograd.backward([torch.stack(outputs), current], [grad_o, grad_final])

    _, _, states = chunked_forward(q, k, v, g, beta, state, size)
    grad_initial, grad_states, dq, dk, dv, dbeta, dg = chunked_backward(q, k, v, g, beta, states, grad_o,
                                                                        grad_final, size)
    assert torch.allclose(grad_initial, lstate.grad, atol=1e-10)
    assert torch.allclose(grad_initial, probes[0].grad, atol=1e-10)
    for c in range(len(probes)):  # dS at chunk c's end is dS at chunk c + 1's start, or the final state's gradient
        expected = probes[c + 1].grad if c + 1 < len(probes) else grad_final
        assert torch.allclose(grad_states[c], expected, atol=1e-10)
    for mine, leaf in zip((dq, dk, dv, dg, dbeta), (lq, lk, lv, lg, lbeta)):
        assert torch.allclose(mine, leaf.grad, atol=1e-9), (mine - leaf.grad).abs().max()


# The worked example as the section prints it.
EXAMPLE = dict(
    k=[[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]],
    q=[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]],
    v=[[3.0], [1.0], [2.0]],
    beta=[0.5, 0.5, 0.5],
    g=[0.0, math.log(0.5), 0.0],
    state=[[1.0], [0.0]],
)
PRINTED_STATES = [[2.0, 0.0], [1.12, 0.16], [1.12, 1.08]]  # S_1, S_2, S_3 (each column written as a pair)
PRINTED_O = [2.0, 0.16, 2.2]
PRINTED_EXP_B = [1.0, 0.5, 0.5]
PRINTED_A = [[0, 0, 0], [0.15, 0, 0], [0, 0.4, 0]]
PRINTED_INVERSE = [[1, 0, 0], [-0.15, 1, 0], [0.06, -0.4, 1]]
PRINTED_U = [1.5, 0.275, 0.89]
PRINTED_W = [[0.5, 0.0], [0.075, 0.2], [-0.03, 0.17]]
PRINTED_NEW = [1.0, 0.2, 0.92]


def test_worked_example_prints_the_numbers_both_routes_give():
    q, k, v, beta, g, state = (torch.tensor(EXAMPLE[name]) for name in ("q", "k", "v", "beta", "g", "state"))
    current, eye = state, torch.eye(2)
    for t in range(3):
        current = g[t].exp() * (eye - beta[t] * torch.outer(k[t], k[t])) @ current + beta[t] * torch.outer(k[t], v[t])
        assert torch.allclose(current[:, 0], torch.tensor(PRINTED_STATES[t]), atol=1e-12)
    o_ref, final_ref = recurrence(q, k, v, g, beta, state)
    assert torch.allclose(o_ref[:, 0], torch.tensor(PRINTED_O), atol=1e-12)

    b, gamma, a, inverse, x_u, x_w = chunk_terms(k, v, g, beta)
    u, w = inverse @ x_u, inverse @ x_w
    assert torch.allclose(b.exp(), torch.tensor(PRINTED_EXP_B), atol=1e-12)
    assert torch.allclose(a, torch.tensor(PRINTED_A, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(inverse, torch.tensor(PRINTED_INVERSE, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(u[:, 0], torch.tensor(PRINTED_U), atol=1e-12)
    assert torch.allclose(w, torch.tensor(PRINTED_W), atol=1e-12)
    assert torch.allclose((u - w @ state)[:, 0], torch.tensor(PRINTED_NEW), atol=1e-12)
    o, final, _ = chunked_forward(q, k, v, g, beta, state, 3)
    assert torch.allclose(o[:, 0], torch.tensor(PRINTED_O), atol=1e-12)
    assert torch.allclose(final[:, 0], torch.tensor(PRINTED_STATES[-1]), atol=1e-12)
    assert torch.allclose(final, final_ref, atol=1e-12)


SECTION = Path(__file__).resolve().parents[1] / "assignment/handout/sections/attention/gated_deltanet.typ"


def test_the_section_prints_these_numbers():
    text = " ".join(SECTION.read_text().split())
    for printed in ("g = (0, log 0.5, 0)", "v = (3, 1, 2)", "S = vec(1, 0)", "= (2, 0)^top", "= (1.12, 0.16)^top",
                    "= (1.12, 1.08)^top", "o_1 = 2", "o_2 = 0.16", "o_3 = 2.2", "e^b = (1, 0.5, 0.5)",
                    "A = mat(0, 0, 0; 0.15, 0, 0; 0, 0.4, 0)", "T = mat(1, 0, 0; -0.15, 1, 0; 0.06, -0.4, 1)",
                    "U = vec(1.5, 0.275, 0.89)", "W = mat(0.5, 0; 0.075, 0.2; -0.03, 0.17)",
                    "W S = (0.5, 0.075, -0.03)^top", "Delta = U - W S = (1, 0.2, 0.92)^top",
                    "64 dot 64 dot 4 = 16384$ bytes"):
        assert printed in text, printed


def test_self_check_answers():
    # The C x C block for C = 64 in float32: 16384 bytes, as torch sizes it.
    assert torch.empty(64, 64, dtype=torch.float32, device="meta").nbytes == 16384
    # beta = 1 with a unit key: S^T k after the step is exactly v, whatever the decay e^g did to the rest.
    gen = torch.Generator().manual_seed(4)
    k = torch.nn.functional.normalize(torch.randn(4, generator=gen), dim=0)
    state, v = torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen)
    g = -0.7
    after = math.exp(g) * (torch.eye(4) - torch.outer(k, k)) @ state + torch.outer(k, v)
    assert torch.allclose(after.T @ k, v, atol=1e-12)
