"""The formulas of the handout's FlashAttention-2 (Triton) section, checked numerically at float64 on the CPU.

The section (assignment/handout/sections/kernels/flash_attention_triton.typ) writes the forward and the backward as
algorithm boxes. The functions below follow those boxes step for step, in blocks of a few rows, with the section's
conventions: S = s Q K^T already holds the scale s = 1/sqrt(d), L is a natural logarithm, P = exp(S - L). They are
compared with autograd through plain softmax attention and with the reference's written-out oracle
`flash_attention_torch`. The byte counts of the section's traffic table and the answers of its self-checks are
recomputed from the same loops.
"""

import math
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from reference.kernels.flash_attention_torch import flash_attention_torch

F64 = torch.float64
SECTION = Path(__file__).resolve().parents[1] / "assignment/handout/sections/kernels/flash_attention_triton.typ"


def flops(function, *args):
    """torch's own count of the FLOPs `function` does (2 per multiply-add of its matrix products), and its result."""
    with FlopCounterMode(display=False) as counter:
        result = function(*args)
    return counter.get_total_flops(), result


def nbytes(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta").nbytes


def blocks(n, size):
    """(start, end) of the blocks of `size` rows of a sequence of n."""
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def visible(q0, q1, k0, k1, causal):
    rows, cols = torch.arange(q0, q1), torch.arange(k0, k1)
    return cols[None, :] <= rows[:, None] if causal else torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)


def key_blocks_of(i0, i1, n, block_n, causal):
    """Key blocks a query block [i0, i1) visits: all of them, or, causal, up to the one holding query i1 - 1."""
    end = i1 if causal else n
    return [(j0, j1) for j0, j1 in blocks(n, block_n) if j0 < end]


def query_blocks_of(j0, j1, n, block_m, causal):
    """Query blocks that see some key of [j0, j1): all of them, or, causal, from the one holding query j0 on."""
    return [(i0, i1) for i0, i1 in blocks(n, block_m) if not causal or i1 > j0]


def needs_mask(i0, i1, j0, j1, n, causal):
    """Whether some (query, key) pair of the tile is invisible: a causal tile crossing the diagonal."""
    return causal and j1 - 1 > i0


class Traffic:
    """Elements read and written by one launch, counted as the boxes load and store them."""

    def __init__(self):
        self.read = 0
        self.written = 0

    def load(self, t):
        self.read += t.numel()
        return t

    def store(self, t):
        self.written += t.numel()
        return t


def tiled_forward(q, k, v, causal, block_m, block_n, traffic=None):
    """The forward box: one program per query block; online softmax over its key blocks."""
    traffic = traffic or Traffic()
    n, d = q.shape
    s = 1 / math.sqrt(d)
    o, L = torch.empty_like(q), torch.empty(n, dtype=F64)
    for i0, i1 in blocks(n, block_m):
        qi = traffic.load(q[i0:i1])  # 1. load Q_i; m = -inf, l = 0, acc = 0
        m = torch.full((i1 - i0,), -math.inf, dtype=F64)
        ell = torch.zeros(i1 - i0, dtype=F64)
        acc = torch.zeros(i1 - i0, d, dtype=F64)
        for j0, j1 in key_blocks_of(i0, i1, n, block_n, causal):  # 2.
            kj, vj = traffic.load(k[j0:j1]), traffic.load(v[j0:j1])  # (a)
            S = s * qi @ kj.T  # (b)
            if needs_mask(i0, i1, j0, j1, n, causal):
                S = S.masked_fill(~visible(i0, i1, j0, j1, causal), -math.inf)
            else:
                assert visible(i0, i1, j0, j1, causal).all()
            m_new = torch.maximum(m, S.amax(dim=1))  # (c)
            P = torch.exp(S - m_new[:, None])
            alpha = torch.exp(m - m_new)
            ell = alpha * ell + P.sum(dim=1)
            acc = alpha[:, None] * acc + P @ vj
            m = m_new
        o[i0:i1] = traffic.store(acc / ell[:, None])  # 3.
        L[i0:i1] = traffic.store(m + torch.log(ell))
    return o, L


def tiled_backward(q, k, v, o, L, dO, causal, block_m, block_n, traffic=None):
    """The backward boxes: the D pre-pass, the dK/dV program per key block (query blocks of block_m streamed) and the
    dQ program per query block (key blocks of block_n streamed). Returns dQ, dK, dV and the traffic per launch."""
    n, d = q.shape
    s = 1 / math.sqrt(d)
    t_pre, t_kv, t_q = Traffic(), Traffic(), Traffic()
    # Pre-pass: D = rowsum(dO * O).
    D = t_pre.store((t_pre.load(dO) * t_pre.load(o)).sum(dim=1))
    dQ, dK, dV = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # dK/dV: one program per key block.
    for j0, j1 in blocks(n, block_n):
        kj, vj = t_kv.load(k[j0:j1]), t_kv.load(v[j0:j1])  # 1.
        dk, dv = torch.zeros(j1 - j0, d, dtype=F64), torch.zeros(j1 - j0, d, dtype=F64)
        for i0, i1 in query_blocks_of(j0, j1, n, block_m, causal):  # 2.
            qi, dOi = t_kv.load(q[i0:i1]), t_kv.load(dO[i0:i1])  # (a)
            Li, Di = t_kv.load(L[i0:i1]), t_kv.load(D[i0:i1])
            P = torch.exp(s * qi @ kj.T - Li[:, None])  # (b)
            if needs_mask(i0, i1, j0, j1, n, causal):
                P = P.masked_fill(~visible(i0, i1, j0, j1, causal), 0.0)
            dv += P.T @ dOi  # (c)
            dP = dOi @ vj.T  # (d)
            dS = P * (dP - Di[:, None])  # (e)
            dk += s * dS.T @ qi  # (f)
        dK[j0:j1], dV[j0:j1] = t_kv.store(dk), t_kv.store(dv)  # 3.
    # dQ: one program per query block.
    for i0, i1 in blocks(n, block_m):
        qi, dOi = t_q.load(q[i0:i1]), t_q.load(dO[i0:i1])  # 1.
        Li, Di = t_q.load(L[i0:i1]), t_q.load(D[i0:i1])
        dq = torch.zeros(i1 - i0, d, dtype=F64)
        for j0, j1 in key_blocks_of(i0, i1, n, block_n, causal):  # 2.
            kj, vj = t_q.load(k[j0:j1]), t_q.load(v[j0:j1])  # (a)
            P = torch.exp(s * qi @ kj.T - Li[:, None])  # (b)
            if needs_mask(i0, i1, j0, j1, n, causal):
                P = P.masked_fill(~visible(i0, i1, j0, j1, causal), 0.0)
            dS = P * (dOi @ vj.T - Di[:, None])  # (c)
            dq += s * dS @ kj  # (d)
        dQ[i0:i1] = t_q.store(dq)  # 3.
    return dQ, dK, dV, (t_pre, t_kv, t_q)


def plain_attention(q, k, v, causal):
    n, d = q.shape
    S = q @ k.T / math.sqrt(d)
    if causal:
        S = S.masked_fill(~visible(0, n, 0, n, True), -math.inf)
    P = torch.softmax(S, dim=-1)
    return P @ v, torch.logsumexp(S, dim=-1), P


CASES = [(n, d, bm, bn, causal) for n, d, bm, bn in [(1, 16, 4, 4), (13, 16, 4, 4), (37, 16, 8, 4), (37, 32, 4, 8),
                                                     (50, 16, 16, 16), (29, 16, 3, 5)]
         for causal in (False, True)]


@pytest.mark.parametrize("n,d,block_m,block_n,causal", CASES)
def test_tiled_forward_and_backward_match_autograd_and_the_oracle(n, d, block_m, block_n, causal):
    gen = torch.Generator().manual_seed(n * 1000 + d + block_m * 7 + block_n + causal)
    q, k, v, dO = (torch.randn(n, d, dtype=F64, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o_ref, L_ref, _ = plain_attention(q, k, v, causal)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(o_ref, (q, k, v), dO)
    o_oracle, L_oracle = flash_attention_torch(q[None], k[None], v[None], causal)

    with torch.no_grad():
        o, L = tiled_forward(q, k, v, causal, block_m, block_n)
        dq, dk, dv, _ = tiled_backward(q, k, v, o, L, dO, causal, block_m, block_n)
    for got, want in [(o, o_ref), (L, L_ref), (o, o_oracle[0]), (L, L_oracle[0]), (dq, dq_ref), (dk, dk_ref),
                      (dv, dv_ref)]:
        torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_jacobian_gives_dS_and_D(causal):
    """dS = P * (dP - D) with D_i = sum_j P_ij dP_ij = dO_i . o_i: the chain rule through S, against autograd."""
    n, d = 23, 16
    gen = torch.Generator().manual_seed(7 + causal)
    q, k, v, dO = (torch.randn(n, d, dtype=F64, generator=gen) for _ in range(4))
    S = (q @ k.T / math.sqrt(d)).requires_grad_()
    masked = S.masked_fill(~visible(0, n, 0, n, causal), -math.inf)
    P = torch.softmax(masked, dim=-1)
    o = P @ v
    (dS_autograd,) = torch.autograd.grad(o, S, dO)
    P, o = P.detach(), o.detach()
    dP = dO @ v.T
    D_sum = (P * dP).sum(dim=1)
    D_dot = (dO * o).sum(dim=1)
    torch.testing.assert_close(D_sum, D_dot, rtol=1e-12, atol=1e-12)
    # The Jacobian of one row's softmax, diag(p) - p p^T, applied to dP.
    dS_jacobian = torch.stack([(torch.diag(P[i]) - torch.outer(P[i], P[i])) @ dP[i] for i in range(n)])
    torch.testing.assert_close(dS_jacobian, P * (dP - D_dot[:, None]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dS_autograd, P * (dP - D_dot[:, None]), rtol=1e-12, atol=1e-12)


def test_traffic_counts_of_the_section():
    """The elements each launch reads and writes, non-causal, as the section's table gives them, with
    T_M = ceil(n / BLOCK_M), T_N = ceil(n / BLOCK_N) and (backward) R = ceil(n / BLOCK_MAJOR)."""
    n, d, major, minor = 50, 16, 16, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v, dO = (torch.randn(n, d, dtype=F64, generator=gen) for _ in range(4))
    # Forward with BLOCK_M = 16, BLOCK_N = 8.
    t = Traffic()
    o, L = tiled_forward(q, k, v, False, major, minor, t)
    t_m = math.ceil(n / major)
    assert t.read == n * d + 2 * t_m * n * d  # Q once, K and V once per query block
    assert t.written == n * d + n  # O and L
    # Backward: BLOCK_MAJOR rows resident, BLOCK_MINOR streamed, in both kernels.
    r = math.ceil(n / major)
    _, _, _, (pre, kv, dq) = tiled_backward(q, k, v, o, L, dO, False, minor, major)
    assert (pre.read, pre.written) == (2 * n * d, n)
    assert kv.read == 2 * n * d + r * (2 * n * d + 2 * n)  # K, V once; Q, dO, L, D once per key block
    assert kv.written == 2 * n * d
    _, _, _, (_, _, dq) = tiled_backward(q, k, v, o, L, dO, False, major, minor)
    assert dq.read == 2 * n * d + 2 * n + r * 2 * n * d  # Q, dO, L, D once; K, V once per query block
    assert dq.written == n * d
    # FLOPs, counted by torch: forward 2 products (S, PV), dK/dV 4 (S, dV, dP, dK), dQ 3 (S, dP, dQ), each 2 n^2 d.
    assert flops(tiled_forward, q, k, v, False, major, minor)[0] == 4 * n * n * d
    assert flops(tiled_backward, q, k, v, o, L, dO, False, minor, major)[0] == (8 + 6) * n * n * d


def test_self_check_answers():
    # Self-check 1: one dK/dV program, BLOCK_M = BLOCK_N = 64, d = 128, bf16 inputs, float32 accumulators.
    kib, f32 = 1024, torch.float32
    assert nbytes(64, 128) / kib == 16  # K_j, V_j, Q_i, dO_i: 16 KiB each in bf16
    accumulators = 2 * nbytes(64, 128, dtype=f32)  # dK and dV in float32
    assert accumulators / kib == 64
    registers = accumulators // torch.empty(0, dtype=torch.int32).element_size()
    assert registers == 16384 and registers / (4 * 32) == 128  # per thread at 4 warps of 32
    assert nbytes(64, 64, dtype=f32) / kib == 16  # one 64 x 64 float32 tile of S, P, dP or dS
    # Self-check 2: causal dK/dV program of key block j, 128 keys resident, query blocks of 64 streamed, n = 1000.
    n, major, minor = 1000, 128, 64
    for j, (j0, j1) in enumerate(blocks(n, major)):
        visited = query_blocks_of(j0, j1, n, minor, True)
        masked = [(i0, i1) for i0, i1 in visited if needs_mask(i0, i1, j0, j1, n, True)]
        assert len(visited) == math.ceil(n / minor) - 2 * j
        assert visited[0][0] == 2 * j * minor
        assert len(masked) == min(2, len(visited))
    assert len(query_blocks_of(384, 512, n, minor, True)) == 10  # j = 3: blocks 6 to 15


def test_intensity_numbers_of_the_section():
    """FLOPs counted by torch, elements streamed counted on the tiled forward: 2 B_M / b FLOPs per streamed byte
    whatever n (measured at n = 512), 128 for B_M = 128 in bf16; at n = 4096, d = 128: 4 MiB of Q, K, V and O against
    8.6 GFLOP, and 128 MiB for the n x n scores and probabilities written out, each written and read once."""
    n, d, block, b = 512, 8, 128, torch.bfloat16.itemsize
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, d, dtype=F64, generator=gen) for _ in range(3))
    traffic = Traffic()
    forward_flops, _ = flops(tiled_forward, q, k, v, False, block, block, traffic)
    streamed = traffic.read - n * d  # all but the one read of Q
    assert forward_flops / (streamed * b) == 128
    n, d = 4096, 128
    meta = [torch.empty(n, d, dtype=torch.bfloat16, device="meta") for _ in range(3)]
    assert flops(lambda q, k, v: (q @ k.T) @ v, *meta)[0] / 1e9 == pytest.approx(8.6, abs=0.05)
    assert 4 * nbytes(n, d) == 4 * 2**20  # Q, K, V read once, O written once
    assert 2 * 2 * nbytes(n, n) == 128 * 2**20  # S and P, each written and read
    text = " ".join(SECTION.read_text().split())
    for printed in ("[forward], [$n d b (1 + 2 T_M)$], [$n d b + 4 n$], [$4 n^2 d$]", "[$8 n^2 d$]", "[$6 n^2 d$]",
                    "$2 B_M \\/ b$ FLOPs per byte, whatever $n$: 128 for $B_M = 128$ in bfloat16",
                    "$4 n d b$ bytes: at $n = 4096$, $d = 128$, 4 MiB against 8.6 GFLOP", "(128 MiB at $n = 4096$)",
                    "$K_j$ and $V_j$ take 16 KiB each; $d K$ and $d V$ in float32 take 64 KiB, 16~384 32-bit",
                    "which is 128 per thread at 4 warps", "float32 tiles $S$, $P$, $d P$, $d S$ (16 KiB each)"):
        assert printed in text, printed
