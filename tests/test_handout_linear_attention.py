"""The linear attention section of the handout: every formula it prints, checked in float64.

The chunked form as the section derives it (O_c = Q'_c S_c + (Q'_c K'_c^T . M_C) V_c, S_(c+1) = S_c + K'_c^T V_c),
the backward's recurrence of dS (dS_(N-1) = 0, dS_(c-1) = dS_c + Q'_c^T dO_c) and the per-chunk gradients are
implemented one chunk at a time for one head and compared with the recurrence, its autograd, and the reference's
own plain-PyTorch forms (`linear_attention_recurrent`, `linear_attention_parallel`), on inputs with several chunks
and a short last one. The FLOP count of the chunked form is compared with the products it is made of. The worked
example's and the self-check's printed numbers are hard-coded as the section prints them and recomputed.
"""

import math
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from reference.attention.linear_attention import linear_attention_parallel, linear_attention_recurrent

pytestmark = pytest.mark.usefixtures("float64_by_default")


def phi(x):
    return torch.nn.functional.elu(x) + 1


def phi_slope(x):
    return torch.where(x > 0, torch.ones_like(x), x.exp())


def recurrence(q, k, v):
    """S_t = S_(t-1) + phi(k_t) v_t^T, o_t = S_t^T phi(q_t); one head, raw q, k [T, K] and v [T, V]."""
    state = torch.zeros(k.shape[1], v.shape[1])
    outputs, states = [], []
    for t in range(q.shape[0]):
        state = state + torch.outer(phi(k[t]), v[t])
        outputs.append(state.T @ phi(q[t]))
        states.append(state)
    return torch.stack(outputs), states


def chunks(n, size):
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def chunked_forward(q, k, v, size):
    """The section's chunked form: (O, the boundary states S_0 .. S_(N-1), the state after the last chunk)."""
    qf, kf = phi(q), phi(k)
    state = torch.zeros(k.shape[1], v.shape[1])
    outputs, boundary = [], []
    for s in chunks(q.shape[0], size):
        c = s.stop - s.start
        mask = torch.ones(c, c).tril()
        boundary.append(state)
        outputs.append(qf[s] @ state + ((qf[s] @ kf[s].T) * mask) @ v[s])
        state = state + kf[s].T @ v[s]
    return torch.cat(outputs), boundary, state


def chunked_backward(q, k, v, boundary, grad_o, size):
    """dS_(N-1) = 0, dS_(c-1) = dS_c + Q'_c^T dO_c; then each chunk's dA, dQ', dK', dV and dq, dk through phi'."""
    qf, kf = phi(q), phi(k)
    parts = chunks(q.shape[0], size)
    grad_states = [None] * len(parts)
    grad_state = torch.zeros(k.shape[1], v.shape[1])
    for c in reversed(range(len(parts))):
        grad_states[c] = grad_state
        grad_state = grad_state + qf[parts[c]].T @ grad_o[parts[c]]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for c, s in enumerate(parts):
        n = s.stop - s.start
        mask = torch.ones(n, n).tril()
        a = (qf[s] @ kf[s].T) * mask
        d_a = (grad_o[s] @ v[s].T) * mask
        d_qf = grad_o[s] @ boundary[c].T + d_a @ kf[s]
        d_kf = v[s] @ grad_states[c].T + d_a.T @ qf[s]
        dv[s] = kf[s] @ grad_states[c] + a.T @ grad_o[s]
        dq[s], dk[s] = d_qf * phi_slope(q[s]), d_kf * phi_slope(k[s])
    return grad_states, dq, dk, dv


def torch_flops(function):
    """The FLOPs of the matrix products `function` runs, as torch counts them."""
    with FlopCounterMode(display=False) as counter:
        function()
    return counter.get_total_flops()


def random_inputs(seed, n=37, key_dim=4, value_dim=3):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, key_dim, generator=gen), torch.randn(n, key_dim, generator=gen),
            torch.randn(n, value_dim, generator=gen))


@pytest.mark.parametrize("size", [1, 4, 16, 37])
def test_chunked_form_matches_the_recurrence(size):
    q, k, v = random_inputs(0)
    o_ref, states = recurrence(q, k, v)
    o, boundary, final = chunked_forward(q, k, v, size)
    assert torch.allclose(o, o_ref, atol=1e-12)
    assert torch.allclose(final, states[-1], atol=1e-12)
    # S_c is the state before chunk c: zero for the first, the recurrence's state after the token before it.
    for c, s in enumerate(chunks(q.shape[0], size)):
        expected = torch.zeros_like(final) if c == 0 else states[s.start - 1]
        assert torch.allclose(boundary[c], expected, atol=1e-12)


def test_the_recurrence_matches_the_reference_forms():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 2, 45, 16, generator=gen), torch.randn(2, 2, 45, 16, generator=gen)
    v = torch.randn(2, 2, 45, 32, generator=gen)
    recurrent = linear_attention_recurrent(q.float(), k.float(), v.float()).double()
    parallel = linear_attention_parallel(q.float(), k.float(), v.float()).double()
    for b in range(2):
        for h in range(2):
            o, _, _ = chunked_forward(q[b, h], k[b, h], v[b, h], 16)
            assert torch.allclose(o, recurrent[b, h], atol=1e-4, rtol=1e-5)
            assert torch.allclose(o, parallel[b, h], atol=1e-4, rtol=1e-5)


def test_the_backward_matches_autograd_of_the_recurrence():
    size = 8
    q, k, v = random_inputs(2)
    n = q.shape[0]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    lq, lk, lv = leaves
    # A zero added to the state at the end of each chunk: its gradient is dS_c, the gradient of S_(c+1).
    parts = chunks(n, size)
    probes = [torch.zeros(k.shape[1], v.shape[1], requires_grad=True) for _ in parts]
    state, outputs = torch.zeros(k.shape[1], v.shape[1]), []
    for c, s in enumerate(parts):
        for t in range(s.start, s.stop):
            state = state + torch.outer(phi(lk[t]), lv[t])
            outputs.append(state.T @ phi(lq[t]))
        state = state + probes[c]
    grad_o = torch.randn(n, v.shape[1], generator=torch.Generator().manual_seed(3))
    torch.autograd.backward(torch.stack(outputs), grad_o)

    _, boundary, _ = chunked_forward(q, k, v, size)
    grad_states, dq, dk, dv = chunked_backward(q, k, v, boundary, grad_o, size)
    for c in range(len(parts)):
        # No output reads the state after the last chunk: its probe gets no gradient, and dS_(N-1) = 0.
        expected = probes[c].grad if probes[c].grad is not None else torch.zeros_like(grad_states[c])
        assert torch.allclose(grad_states[c], expected, atol=1e-12)
        later = sum((phi(q[s]).T @ grad_o[s] for s in parts[c + 1:]), torch.zeros_like(grad_states[c]))
        assert torch.allclose(grad_states[c], later, atol=1e-12)  # the stub's definition of dS_c
    assert torch.count_nonzero(grad_states[-1]) == 0
    for mine, leaf in zip((dq, dk, dv), leaves):
        assert torch.allclose(mine, leaf.grad, atol=1e-11), (mine - leaf.grad).abs().max()


def chunked_flops(n, key_dim, value_dim, size):
    """Multiply-adds of the chunked form's products, two FLOPs each, counted product by product."""
    total = 0
    for s in chunks(n, size):
        c = s.stop - s.start
        total += 2 * c * key_dim * c  # Q' K'^T
        total += 2 * c * c * value_dim  # A V
        total += 2 * c * key_dim * value_dim  # Q' S
        total += 2 * key_dim * c * value_dim  # K'^T V
    return total


def test_flop_count():
    for n, key_dim, value_dim, size in ((4096, 64, 64, 64), (256, 16, 32, 32)):
        formula = 2 * n * size * (key_dim + value_dim) + 4 * n * key_dim * value_dim
        assert chunked_flops(n, key_dim, value_dim, size) == formula
        # C = T: the parallel form's products, plus the state's (here unused).
        parallel = 2 * n * n * (key_dim + value_dim)
        assert chunked_flops(n, key_dim, value_dim, n) == parallel + 4 * n * key_dim * value_dim


def test_self_check_answers():
    # FLOPs as torch counts them: the section's chunked form (linear in T for whole chunks: counted at T = 256 and
    # scaled); its 64 blocks' two C x C products; the rest, the states' products; the parallel form's T x T products.
    q, k, v = random_inputs(6, n=256, key_dim=64, value_dim=64)
    chunked = torch_flops(lambda: chunked_forward(q, k, v, 64)) * 4096 // 256
    assert chunked == chunked_flops(4096, 64, 64, 64) == 134217728 and round(chunked / 1e8, 2) == 1.34
    meta = [torch.empty(4096, 64, device="meta") for _ in range(3)]
    blocks = 64 * torch_flops(lambda: (meta[0][:64] @ meta[1][:64].T) @ meta[2][:64])
    states = chunked - blocks
    assert (blocks, states) == (67108864, 67108864)
    parallel = torch_flops(lambda: (meta[0] @ meta[1].T) @ meta[2])
    assert parallel == 4294967296 and round(parallel / 1e9, 2) == 4.29 and parallel // chunked == 32
    # T = 100, C = 32: four chunks, so four boundary states, the first zero, and dS_3 = 0.
    assert math.ceil(100 / 32) == len(chunks(100, 32)) == 4
    q, k, v = random_inputs(5, n=100)
    _, boundary, _ = chunked_forward(q, k, v, 32)
    assert len(boundary) == 4 and torch.count_nonzero(boundary[0]) == 0
    grad_states, *_ = chunked_backward(q, k, v, boundary, torch.ones(100, 3), 32)
    assert torch.count_nonzero(grad_states[3]) == 0 and torch.count_nonzero(grad_states[2]) > 0


# The worked example as the section prints it.
Q_RAW, K_RAW, V = [0.0, 1.0, 0.0, 1.0], [1.0, 0.0, -math.log(2), 0.0], [1.0, 2.0, 4.0, -1.0]
PRINTED = dict(
    q_features=[1, 2, 1, 2], k_features=[2, 1, 0.5, 1], states=[2, 4, 6, 5], o=[2, 8, 6, 10],
    a=[[[2, 0], [4, 2]], [[0.5, 0], [1, 2]]], av=[[2, 8], [2, 2]], inter_1=[4, 8], s_1=4,
    d_a=[[[1, 0], [1, 2]], [[4, 0], [4, -1]]], d_s=[3, 0],
    d_qf=[[2, 4], [6, 5]], d_kf=[[6, 10], [12, -2]], d_v=[[12, 5], [1.5, 2]],
    dq=[2, 4, 6, 5], dv=[12, 5, 1.5, 2], dk=[6, 10, 6, -2],
)


def tensor(values):
    return torch.tensor(values, dtype=torch.float64)


def test_worked_example():
    q, k, v = (tensor(x)[:, None] for x in (Q_RAW, K_RAW, V))
    assert torch.allclose(phi(q)[:, 0], tensor(PRINTED["q_features"]), atol=1e-15)
    assert torch.allclose(phi(k)[:, 0], tensor(PRINTED["k_features"]), atol=1e-15)
    o_ref, states = recurrence(q, k, v)
    assert torch.allclose(torch.stack(states).flatten(), tensor(PRINTED["states"]), atol=1e-14)
    assert torch.allclose(o_ref[:, 0], tensor(PRINTED["o"]), atol=1e-14)
    o, boundary, _ = chunked_forward(q, k, v, 2)
    assert torch.allclose(o[:, 0], tensor(PRINTED["o"]), atol=1e-14)
    assert boundary[1].item() == pytest.approx(PRINTED["s_1"])
    assert torch.allclose(phi(q[2:]) @ boundary[1], tensor(PRINTED["inter_1"])[:, None], atol=1e-14)
    qf, kf = phi(q), phi(k)
    mask = torch.ones(2, 2).tril()
    ones = torch.ones(4, 1)
    for c, s in enumerate(chunks(4, 2)):
        a = (qf[s] @ kf[s].T) * mask
        assert torch.allclose(a, tensor(PRINTED["a"][c]), atol=1e-14)
        assert torch.allclose((a @ v[s])[:, 0], tensor(PRINTED["av"][c]), atol=1e-14)
        assert torch.allclose((ones[s] @ v[s].T) * mask, tensor(PRINTED["d_a"][c]), atol=1e-14)
    grad_states, dq, dk, dv = chunked_backward(q, k, v, boundary, ones, 2)
    assert [g.item() for g in grad_states] == PRINTED["d_s"]
    for c, s in enumerate(chunks(4, 2)):
        d_a = (ones[s] @ v[s].T) * mask
        a = (qf[s] @ kf[s].T) * mask
        assert torch.allclose((ones[s] @ boundary[c].T + d_a @ kf[s])[:, 0], tensor(PRINTED["d_qf"][c]), atol=1e-14)
        assert torch.allclose((v[s] @ grad_states[c].T + d_a.T @ qf[s])[:, 0], tensor(PRINTED["d_kf"][c]),
                              atol=1e-14)
        assert torch.allclose((kf[s] @ grad_states[c] + a.T @ ones[s])[:, 0], tensor(PRINTED["d_v"][c]), atol=1e-14)
    for mine, printed in ((dq, "dq"), (dk, "dk"), (dv, "dv")):
        assert torch.allclose(mine[:, 0], tensor(PRINTED[printed]), atol=1e-14)
    # dq is S_t: o_t = q'_t S_t, and phi' = 1 at the raw queries 0 and 1.
    assert torch.allclose(dq[:, 0], tensor(PRINTED["states"]), atol=1e-14)


SECTION = Path(__file__).resolve().parents[1] / "assignment/handout/sections/attention/linear_attention.typ"


def test_the_section_prints_these_numbers():
    text = " ".join(SECTION.read_text().split())
    for printed in ("q = (0, 1, 0, 1)", "k = (1, 0, -ln 2, 0)", "q' = (1, 2, 1, 2)", "k' = (2, 1, 1\\/2, 1)",
                    "v = (1, 2, 4, -1)", "S_t = 2, 4, 6, 5", "(2, 8, 6, 10)", "A = mat(2, 0; 4, 2)",
                    "O_0 = A V_0 = (2, 8)", "S_1 = 2 dot 1 + 1 dot 2 = 4", "Q'_1 S_1 = (4, 8)",
                    "A = mat(1\\/2, 0; 1, 2)", "A V_1 = (2, 2)", "O_1 = (6, 10)", "dif A = mat(1, 0; 1, 2)",
                    "dif A = mat(4, 0; 4, -1)", "dif S_0 = Q'^top_1 dif O_1 = 3",
                    "dif Q'_1 = (4, 4) + (2, 1) = (6, 5)", "dif K'_1 = (12, -2)", "dif V_1 = (3\\/2, 2)",
                    "dif Q'_0 = (2, 4)", "dif K'_0 = (3, 6) + (3, 4) = (6, 10)",
                    "dif V_0 = (6, 3) + (6, 2) = (12, 5)", "dif q = (2, 4, 6, 5)", "dif v = (12, 5, 3\\/2, 2)",
                    "dif k = (6, 10, 6, -2)", "2 T C (K + V) + 4 T K V", "2 C^2 (K + V) + 4 C K V",
                    "About $1.34 dot 10^8$", "2 dot 4096 dot 64 dot 128 = 67.1 dot 10^6",
                    "4 dot 4096 dot 64^2 = 67.1 dot 10^6", "4.29 dot 10^9", "32 times fewer", "ceil(100 \\/ 32) = 4"):
        assert printed in text, printed
