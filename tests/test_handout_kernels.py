"""The handout's Triton kernels chapter: the formulas, worked examples and self-check answers of the RMSNorm, matmul
and FlashAttention-2 (PyTorch) sections, and the self-check answers of the row sum, softmax and analysis sections.

Every formula is implemented here as its section writes it, at float64 on small sizes, and compared with the
reference's plain PyTorch functions (`rmsnorm_torch`, `matmul_torch`, `flash_attention_torch`, `row_sum_torch`,
`softmax_torch`) and autograd through them. The algorithm boxes are followed step for step (RMSNorm's backward by
bands of rows and a partial buffer, the matmul tile loop and its grouped program order, the FlashAttention forward
and its one-loop-nest backward). The numbers each section prints are hard-coded as printed, recomputed, and looked
up in the section's text. The analysis section's self-check is checked not to print the graded answers.
"""

import math
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from reference.kernels import flash_attention_torch as flash_module
from reference.kernels.flash_attention_torch import flash_attention_torch
from reference.kernels.matmul import matmul_torch
from reference.kernels.rmsnorm import rmsnorm_torch
from reference.kernels.row_sum import row_sum_torch
from reference.kernels.softmax import softmax_torch

pytestmark = pytest.mark.usefixtures("float64_by_default")

SECTIONS = Path(__file__).resolve().parents[1] / "assignment/handout/sections/kernels"
KIB, MIB, GIB = 2**10, 2**20, 2**30


def section_text(name):
    """The section's source with runs of white space (line breaks) folded to one space."""
    return " ".join((SECTIONS / f"{name}.typ").read_text().split())


# ---------------------------------------------------------------------------------------------------------------
# RMSNorm


def rmsnorm_backward_as_written(x, w, g, eps):
    """r, x_hat = x r, u = g w, c = mean(u x_hat), dx = r (u - x_hat c), dw = sum over rows of g x_hat."""
    r = 1 / torch.sqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    x_hat = x * r
    u = g * w
    c = (u * x_hat).mean(dim=-1, keepdim=True)
    return r * (u - x_hat * c), (g * x_hat).reshape(-1, x.shape[-1]).sum(dim=0)


def rmsnorm_backward_by_programs(x, w, g, eps, programs, block_rows):
    """Algorithm 1: each program owns a contiguous band of rows, walks it BLOCK_ROWS at a time, writes dx as it goes
    and its column sum of g x_hat once, as its own row of a [P, D] buffer; a second pass sums the buffer's columns."""
    n, d = x.shape
    per_program = math.ceil(n / programs)
    dx = torch.full_like(x, math.nan)
    partial = torch.full((programs, d), math.nan)
    for p in range(programs):
        a = torch.zeros(d)  # 1.
        for start in range(p * per_program, min((p + 1) * per_program, n), block_rows):  # 2.
            rows = slice(start, min(start + block_rows, (p + 1) * per_program, n))
            xb, gb = x[rows], g[rows]  # (a)
            r = 1 / torch.sqrt(xb.square().mean(dim=1, keepdim=True) + eps)
            x_hat, u = xb * r, gb * w  # (b)
            c = (u * x_hat).sum(dim=1, keepdim=True) / d
            dx[rows] = r * (u - x_hat * c)  # (c)
            a += (gb * x_hat).sum(dim=0)  # (d)
        partial[p] = a  # 3.
    return dx, partial.sum(dim=0), partial  # 4.


@pytest.mark.parametrize("shape,eps", [((5, 7), 1e-6), ((3, 4, 1), 1e-2), ((9, 16), 1.0), ((2, 3), 0.0)])
def test_rmsnorm_backward_formula_matches_autograd_of_the_reference(shape, eps):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen).requires_grad_()
    w = torch.randn(shape[-1], generator=gen).requires_grad_()
    g = torch.randn(shape, generator=gen)
    y = rmsnorm_torch(x, w, eps) if eps > 0 else x * torch.rsqrt(x.square().mean(-1, keepdim=True)) * w
    dx_autograd, dw_autograd = torch.autograd.grad(y, (x, w), g)
    x, w = x.detach(), w.detach()
    dx, dw = rmsnorm_backward_as_written(x, w, g, eps)
    torch.testing.assert_close(dx, dx_autograd, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(dw, dw_autograd, rtol=1e-11, atol=1e-11)
    # The same gradient in terms of rms = 1 / r: rms^-1 (u - x mean(x u) / rms^2).
    rms = torch.sqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    u = g * w
    torch.testing.assert_close(dx, (u - x * (x * u).mean(dim=-1, keepdim=True) / rms**2) / rms, rtol=1e-11, atol=1e-11)
    # The first term alone (r treated as a constant) is not the gradient.
    assert not torch.allclose(u / rms, dx_autograd, atol=1e-3)


def test_rmsnorm_dr_dx_and_the_projection_identity():
    """dr/dx_k = -r^3 x_k / D, and sum_k x_k dx_k = eps r^3 sum_k u_k x_k (zero for eps = 0)."""
    gen = torch.Generator().manual_seed(3)
    d, eps = 6, 0.3
    x = torch.randn(d, generator=gen).requires_grad_()
    r = 1 / torch.sqrt(x.square().mean() + eps)
    (dr,) = torch.autograd.grad(r, x)
    torch.testing.assert_close(dr, -(r**3) * x / d, rtol=1e-12, atol=1e-12)
    x, r = x.detach(), r.detach()
    w, g = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    dx, _ = rmsnorm_backward_as_written(x, w, g, eps)
    assert (x * dx).sum().item() == pytest.approx((eps * r**3 * (g * w * x).sum()).item(), rel=1e-10)
    dx0, _ = rmsnorm_backward_as_written(x, w, g, 0.0)
    assert abs((x * dx0).sum().item()) < 1e-12


@pytest.mark.parametrize("n,programs,block_rows", [(16, 4, 2), (13, 4, 2), (7, 3, 4), (5, 8, 1)])
def test_rmsnorm_algorithm_by_bands_and_partial_rows(n, programs, block_rows):
    gen = torch.Generator().manual_seed(n + programs)
    x, g = torch.randn(n, 6, generator=gen), torch.randn(n, 6, generator=gen)
    w, eps = torch.randn(6, generator=gen), 1e-5
    dx, dw, partial = rmsnorm_backward_by_programs(x, w, g, eps, programs, block_rows)
    dx_ref, dw_ref = rmsnorm_backward_as_written(x, w, g, eps)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-12, atol=1e-12)
    assert not partial.isnan().any()  # every program wrote its own row, even one with no rows (a zero row)


RMS_EXAMPLE = {"x": [[1.0, 7.0], [-7.0, 1.0]], "g": [[1.0, -1.0], [0.5, 2.0]], "w": [2.0, 1.0]}
RMS_PRINTED = {"r": [0.2, 0.2], "x_hat": [[0.2, 1.4], [-1.4, 0.2]], "u": [[2.0, -1.0], [1.0, 2.0]], "c": [-0.5, -0.5],
               "dx": [[0.42, -0.06], [0.06, 0.42]], "partial": [[0.2, -1.4], [-0.7, 0.4]], "dw": [-0.5, -1.0],
               "ru": [0.4, -0.2]}


def test_rmsnorm_worked_example():
    x, g, w = (torch.tensor(RMS_EXAMPLE[k]) for k in ("x", "g", "w"))
    assert x.square().mean(dim=1).tolist() == [25.0, 25.0]
    r = 1 / torch.sqrt(x.square().mean(dim=1, keepdim=True))
    x_hat, u = x * r, g * w
    close = {"rtol": 0, "atol": 1e-12}
    torch.testing.assert_close(r[:, 0], torch.tensor(RMS_PRINTED["r"]), **close)
    torch.testing.assert_close(x_hat, torch.tensor(RMS_PRINTED["x_hat"]), **close)
    torch.testing.assert_close(u, torch.tensor(RMS_PRINTED["u"]), **close)
    torch.testing.assert_close((u * x_hat).mean(dim=1), torch.tensor(RMS_PRINTED["c"]), **close)
    dx, dw, partial = rmsnorm_backward_by_programs(x, w, g, 0.0, programs=2, block_rows=1)
    torch.testing.assert_close(dx, torch.tensor(RMS_PRINTED["dx"]), **close)
    torch.testing.assert_close(partial, torch.tensor(RMS_PRINTED["partial"]), **close)
    torch.testing.assert_close(dw, torch.tensor(RMS_PRINTED["dw"]), **close)
    torch.testing.assert_close((x * dx).sum(dim=1), torch.zeros(2), **close)  # orthogonal to its row
    torch.testing.assert_close((r * u)[0], torch.tensor(RMS_PRINTED["ru"]), **close)
    # The reference at a tiny eps, and autograd through it.
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = rmsnorm_torch(xg, wg, 1e-12)
    dx_ref, dw_ref = torch.autograd.grad(y, (xg, wg), g)
    torch.testing.assert_close(dx_ref, dx, rtol=0, atol=1e-9)
    torch.testing.assert_close(dw_ref, dw, rtol=0, atol=1e-9)
    text = section_text("rmsnorm")
    for printed in ("$D = 2$, $w = (2, 1)$", "[$(1, 7)$], [$(1, -1)$], [$0.2$], [$(0.2, 1.4)$], [$(2, -1)$], [$-0.5$], "
                    "[$(0.42, -0.06)$]", "[$(-7, 1)$], [$(0.5, 2)$], [$0.2$], [$(-1.4, 0.2)$], [$(1, 2)$], [$-0.5$], "
                    "[$(0.06, 0.42)$]", "$m = 25$", "$g dot.o hat(x) = (0.2, -1.4)$ and $(-0.7, 0.4)$",
                    "$d w = (-0.5, -1)$", "$1 dot 0.42 - 7 dot 0.06 = 0$", "$r u = (0.4, -0.2)$"):
        assert printed in text, printed


def test_rmsnorm_self_check_answers():
    # (1) bf16 (16384, 8192), 132 SMs x 2 programs.
    n, d, programs = 16384, 8192, 132 * 2
    main = 3 * n * d * 2
    partial = programs * d * 4
    assert main == 768 * MIB
    assert partial == 8.25 * MIB and 2 * partial == 16.5 * MIB
    assert 2 * partial / main == pytest.approx(0.02, abs=0.002)
    # (2) w = 1, g = x_hat: dx = eps r^3 x_hat; without the second term, r x_hat of norm r sqrt(D) at eps = 0.
    gen = torch.Generator().manual_seed(5)
    x, eps = torch.randn(7, generator=gen), 0.01
    r = 1 / torch.sqrt(x.square().mean() + eps)
    dx, _ = rmsnorm_backward_as_written(x, torch.ones(7), x * r, eps)
    torch.testing.assert_close(dx, eps * r**3 * x * r, rtol=1e-12, atol=1e-14)
    r0 = 1 / torch.sqrt(x.square().mean())
    assert torch.linalg.vector_norm(r0 * x * r0).item() == pytest.approx((r0 * math.sqrt(7)).item(), rel=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# Matmul


def grouped_tile(p, tile_rows, tile_cols, group_m):
    """The section's formula: (tile_row, tile_col) of program p."""
    g = group_m * tile_cols
    first = (p // g) * group_m
    r = min(tile_rows - first, group_m)
    return first + (p % g) % r, (p % g) // r


def row_major_tile(p, tile_rows, tile_cols):
    return p // tile_cols, p % tile_cols


def panels_of_wave(order, wave):
    """Distinct panels of A (tile rows) and of B (tile columns) that programs 0 .. wave-1 read."""
    tiles = [order(p) for p in range(wave)]
    return len({r for r, _ in tiles}), len({c for _, c in tiles})


@pytest.mark.parametrize("tile_rows,tile_cols,group_m", [(6, 8, 3), (7, 8, 3), (64, 64, 8), (5, 3, 8), (1, 9, 4),
                                                         (16, 8, 8)])
def test_grouped_order_is_a_bijection_onto_the_tiles(tile_rows, tile_cols, group_m):
    tiles = [grouped_tile(p, tile_rows, tile_cols, group_m) for p in range(tile_rows * tile_cols)]
    assert sorted(tiles) == [(r, c) for r in range(tile_rows) for c in range(tile_cols)]


def test_grouped_order_numbers_of_the_section():
    assert grouped_tile(13, 6, 8, 3) == (1, 4)
    assert grouped_tile(50, 7, 8, 3) == (6, 2)  # a last group of one tile row: first = 6, r = 1
    assert (3 * 8, min(7 - 6, 3)) == (24, 1)
    # The figure: programs 0 to 8 of 6 x 8 tiles.
    assert panels_of_wave(lambda p: row_major_tile(p, 6, 8), 9) == (2, 8)
    assert panels_of_wave(lambda p: grouped_tile(p, 6, 8, 3), 9) == (3, 3)
    # 8192^3 in bf16, 128 x 128 tiles (64 x 64), a wave of 132 programs.
    row_major = panels_of_wave(lambda p: row_major_tile(p, 64, 64), 132)
    grouped = panels_of_wave(lambda p: grouped_tile(p, 64, 64, 8), 132)
    assert row_major == (3, 64) and sum(row_major) == 67
    assert grouped == (8, 17) and sum(grouped) == 25
    panel = torch.empty(128, 8192, dtype=torch.bfloat16, device="meta")  # 128 rows of A (or columns of B)
    panel_bytes = panel.nbytes
    assert panel_bytes == 2 * MIB
    with FlopCounterMode(display=False) as counter:
        panel @ panel.T  # one 128 x 128 tile of C
    flops = 132 * counter.get_total_flops()
    assert round(flops / (67 * panel_bytes)) == 252
    assert round(flops / (25 * panel_bytes)) == 676
    assert flops / (132 * 2 * panel_bytes) == 64  # two panels per tile, nothing shared
    # Self-check 3: M = 2048, N = 1024, 128 x 128 tiles, GROUP_M = 8, program 100.
    assert grouped_tile(100, 2048 // 128, 1024 // 128, 8) == (12, 4)
    text = section_text("matmul")
    for printed in ("$p = 13$ gives $g = 24$, $\"first\" = 0$, $r = 3$, tile $(13 mod 3, floor(13 \\/ 3)) = (1, 4)$",
                    "$p = 50$ falls in a group of one row: $\"first\" = 6$, $r = 1$, tile $(6, 2)$",
                    "3 panels of $A$ and 64 of $B$, 67 panels of 2 MiB, for 132 tiles",
                    "reads 8 and 17, 25 panels", "make 252 and 676 FLOPs per byte", "against 64 for tiles"):
        assert printed in text, printed


def tile_loop_matmul(a, b, block_m, block_n, block_k, group_m, gelu=False):
    """Algorithm 1 for every program, with masked (zero-filled) loads past M, N and K and a masked store; returns C
    and the number of elements loaded from A and B."""
    m, k = a.shape
    n = b.shape[1]
    tile_rows, tile_cols = math.ceil(m / block_m), math.ceil(n / block_n)
    c = torch.full((m, n), math.nan)
    loaded = 0
    for p in range(tile_rows * tile_cols):
        tile_row, tile_col = grouped_tile(p, tile_rows, tile_cols, group_m)  # 1.
        rows = torch.arange(tile_row * block_m, (tile_row + 1) * block_m)
        cols = torch.arange(tile_col * block_n, (tile_col + 1) * block_n)
        acc = torch.zeros(block_m, block_n)  # 2.
        for k0 in range(0, k, block_k):  # 3.
            lanes = k0 + torch.arange(block_k)
            a_tile = torch.zeros(block_m, block_k)  # (a): masked loads, 0 past the edges
            b_tile = torch.zeros(block_k, block_n)
            a_ok = (rows[:, None] < m) & (lanes[None, :] < k)
            b_ok = (lanes[:, None] < k) & (cols[None, :] < n)
            a_tile[a_ok] = a[rows[:, None].clamp(max=m - 1), lanes[None, :].clamp(max=k - 1)][a_ok]
            b_tile[b_ok] = b[lanes[:, None].clamp(max=k - 1), cols[None, :].clamp(max=n - 1)][b_ok]
            loaded += block_m * block_k + block_k * block_n
            acc = acc + a_tile @ b_tile  # (b)
        if gelu:  # 4.
            acc = 0.5 * acc * (1 + torch.tanh(math.sqrt(2 / math.pi) * (acc + 0.044715 * acc**3)))
        r0, c0 = tile_row * block_m, tile_col * block_n  # 5. masked store
        rows_in, cols_in = min(block_m, m - r0), min(block_n, n - c0)
        c[r0:r0 + rows_in, c0:c0 + cols_in] = acc[:rows_in, :cols_in]
    return c, loaded


@pytest.mark.parametrize("m,n,k,gelu", [(13, 9, 100, False), (5, 17, 33, True), (32, 32, 32, False), (1, 1, 1, True)])
def test_matmul_tile_loop_matches_the_reference(m, n, k, gelu):
    gen = torch.Generator().manual_seed(m * n + k)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    c, loaded = tile_loop_matmul(a, b, 8, 16, 32, 2, gelu)
    torch.testing.assert_close(c, matmul_torch(a, b, "gelu" if gelu else None), rtol=1e-12, atol=1e-12)
    # Loads, over the padded grid: M' N' K' (1/BLOCK_N + 1/BLOCK_M) elements.
    mp, np_, kp = 8 * math.ceil(m / 8), 16 * math.ceil(n / 16), 32 * math.ceil(k / 32)
    assert loaded == mp * np_ * kp * (1 / 16 + 1 / 8)


def test_matmul_intensity_numbers_of_the_section():
    def tile_intensity(bm, bn, b):
        return 2 * bm * bn / ((bm + bn) * b)

    for bm, bn, bk, b in [(128, 256, 64, 2), (64, 32, 16, 4)]:
        step = 2 * bm * bn * bk / ((bm + bn) * bk * b)
        assert step == pytest.approx(tile_intensity(bm, bn, b)) == pytest.approx(2 / (b * (1 / bm + 1 / bn)))
    assert round(tile_intensity(128, 256, 2)) == 85
    assert 700e12 / 4.2e12 == pytest.approx(170, rel=0.02)
    assert round(2 * 4096**3 / (3 * 4096**2 * 2)) == 1365
    assert tile_intensity(128, 256, 2) / (700e12 / 4.2e12) == pytest.approx(0.5, abs=0.02)  # half of peak
    # The K loop of the hint: K = 100, BLOCK_K = 32.
    steps = list(range(0, 100, 32))
    assert steps == [0, 32, 64, 96]
    assert [lane for lane in range(32) if lane < 100 - steps[-1]] == [0, 1, 2, 3]


def test_matmul_self_check_answers():
    """(1) The elements Algorithm 1 loads, counted on it for M = N = K = 256 with 128 x 128 tiles and scaled to 8192
    (the count is cubic in the side), in 16-bit; (2) sizes of a stage and of the accumulator as torch gives them."""
    n, small = 8192, 256
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(small, small, generator=gen), torch.randn(small, small, generator=gen)
    _, loaded = tile_loop_matmul(a, b, 128, 128, 64, 8)
    loads = loaded * (n // small) ** 3 * 2
    distinct = 2 * torch.empty(n, n, dtype=torch.bfloat16, device="meta").nbytes
    assert (loads, distinct) == (16 * GIB, 256 * MIB) and loads / distinct == 64
    stage = sum(torch.empty(*shape, dtype=torch.bfloat16, device="meta").nbytes for shape in ((128, 64), (64, 256)))
    assert stage == 48 * KIB and 3 * stage == 144 * KIB <= 228 * KIB
    accumulator = torch.empty(128, 256, dtype=torch.float32, device="meta").nbytes
    assert accumulator // 4 // (8 * 32) == 128  # 32-bit registers over 8 warps of 32 threads
    text = section_text("matmul")
    for printed in ("$M N K (1 \\/ 128 + 1 \\/ 128) dot 2$ bytes $= 16$ GiB",
                    "against $2 dot 8192^2 dot 2$ bytes $= 256$ MiB",
                    "each element is loaded 64 times", "$(128 + 256) dot 64 dot 2$ bytes $= 48$ KiB, 144 KiB for three",
                    "takes 128 of a thread's 255 registers", "$p mod g = 36$: tile (12, 4)"):
        assert printed in text, printed


# ---------------------------------------------------------------------------------------------------------------
# FlashAttention-2 in PyTorch


def tiles(n, size, first=0):
    return [(start, min(start + size, n)) for start in range(first, n, size)]


def visible(q0, q1, k0, k1):
    return torch.arange(k0, k1)[None, :] <= torch.arange(q0, q1)[:, None]


def online_forward(q, k, v, causal, size):
    """Algorithm 1, steps 1-2, one (batch, head): online max, sum and output per query tile."""
    n, d = q.shape
    s = 1 / math.sqrt(d)
    o, L = torch.empty(n, v.shape[1]), torch.empty(n)
    for i0, i1 in tiles(n, size):
        m, ell, a = torch.full((i1 - i0,), -math.inf), torch.zeros(i1 - i0), torch.zeros(i1 - i0, v.shape[1])
        for j0, j1 in tiles(i1 if causal else n, size):
            S = s * q[i0:i1] @ k[j0:j1].T  # (a)
            if causal and j1 - 1 > i0:
                S = S.masked_fill(~visible(i0, i1, j0, j1), -math.inf)
            m_new = torch.maximum(m, S.amax(dim=1))  # (b)
            p_tilde, alpha = torch.exp(S - m_new[:, None]), torch.exp(m - m_new)
            ell, a, m = alpha * ell + p_tilde.sum(dim=1), alpha[:, None] * a + p_tilde @ v[j0:j1], m_new  # (c)
        o[i0:i1], L[i0:i1] = a / ell[:, None], m + torch.log(ell)  # 2.
    return o, L


def one_nest_backward(q, k, v, o, L, dO, causal, size):
    """Algorithm 1, steps 3-5: D first, then key tiles outside and the query tiles that see them inside."""
    n, d = q.shape
    s = 1 / math.sqrt(d)
    D = (dO * o).sum(dim=1)  # 3.
    dQ, dK, dV = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for j0, j1 in tiles(n, size):  # 4.
        for i0, i1 in tiles(n, size, first=j0 if causal else 0):
            P = torch.exp(s * q[i0:i1] @ k[j0:j1].T - L[i0:i1, None])  # (a)
            if causal and j1 - 1 > i0:
                P = P.masked_fill(~visible(i0, i1, j0, j1), 0.0)
            dV[j0:j1] += P.T @ dO[i0:i1]  # (b)
            dS = P * (dO[i0:i1] @ v[j0:j1].T - D[i0:i1, None])
            dQ[i0:i1] += s * dS @ k[j0:j1]  # (c)
            dK[j0:j1] += s * dS.T @ q[i0:i1]
    return dQ, dK, dV


@pytest.mark.parametrize("n,d,size,causal", [(n, d, size, causal) for n, d, size in [(1, 16, 16), (40, 16, 16),
                                                                                   (37, 32, 8), (50, 16, 5)]
                                             for causal in (False, True)])
def test_flash_algorithm_matches_the_reference_and_autograd(n, d, size, causal):
    gen = torch.Generator().manual_seed(n * 10 + d + causal)
    q, k, v, dO = (torch.randn(n, d, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o_ref, L_ref = flash_attention_torch(q[None], k[None], v[None], causal)
    grads = torch.autograd.grad(o_ref, (q, k, v), dO[None])
    with torch.no_grad():
        o, L = online_forward(q, k, v, causal, size)
        torch.testing.assert_close(o, o_ref[0], rtol=1e-11, atol=1e-11)
        torch.testing.assert_close(L, L_ref[0], rtol=1e-11, atol=1e-11)
        for got, want in zip(one_nest_backward(q, k, v, o, L, dO, causal, size), grads):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        # The reference's own tiled function, at float32.
        o32 = flash_module.flash_attention(*(t[None].float() for t in (q, k, v)), causal)
        torch.testing.assert_close(o32[0].double(), o, rtol=1e-5, atol=1e-5)


def test_online_state_is_the_sums_over_the_keys_seen():
    """After each key tile, (m, l, a) are the max, sum and weighted sum over the keys seen so far; m cancels in
    a / l."""
    gen = torch.Generator().manual_seed(11)
    scores, values = torch.randn(23, generator=gen) * 4, torch.randn(23, 3, generator=gen)
    m, ell, a = -math.inf, 0.0, torch.zeros(3)
    for j0, j1 in tiles(23, 5):
        m_new = max(m, scores[j0:j1].max().item())
        ell = math.exp(m - m_new) * ell + torch.exp(scores[j0:j1] - m_new).sum().item()
        a = math.exp(m - m_new) * a + torch.exp(scores[j0:j1] - m_new) @ values[j0:j1]
        m = m_new
        seen = scores[:j1]
        assert m == seen.max().item()
        assert ell == pytest.approx(torch.exp(seen - m).sum().item(), rel=1e-13)
        torch.testing.assert_close(a, torch.exp(seen - m) @ values[:j1], rtol=1e-13, atol=1e-13)
        assert ell >= 1
    torch.testing.assert_close(a / ell, torch.softmax(scores, 0) @ values, rtol=1e-13, atol=1e-13)
    assert m + math.log(ell) == pytest.approx(torch.logsumexp(scores, 0).item(), rel=1e-14)


def test_flash_worked_example(monkeypatch):
    ln2 = math.log(2)
    S, v = torch.tensor([0, ln2, 2 * ln2, 0]), torch.tensor([1.0, 4, 3, -2])
    m1 = S[:2].max().item()
    ell1, a1 = torch.exp(S[:2] - m1).sum().item(), (torch.exp(S[:2] - m1) @ v[:2]).item()
    assert (m1, ell1, a1) == (pytest.approx(ln2), pytest.approx(1.5), pytest.approx(4.5))
    m2 = max(m1, S[2:].max().item())
    alpha = math.exp(m1 - m2)
    ell2 = alpha * ell1 + torch.exp(S[2:] - m2).sum().item()
    a2 = alpha * a1 + (torch.exp(S[2:] - m2) @ v[2:]).item()
    assert (m2, alpha, ell2, a2) == (pytest.approx(2 * ln2), pytest.approx(0.5), pytest.approx(2), pytest.approx(4.75))
    assert a2 / ell2 == pytest.approx(2.375) == pytest.approx((1 + 8 + 12 - 2) / 8)
    assert m2 + math.log(ell2) == pytest.approx(3 * ln2)
    torch.testing.assert_close(torch.exp(S), torch.tensor([1.0, 2, 4, 1]))
    # Backward with dO = 1: P, D, dP = v, dS, which sums to 0; autograd through the softmax agrees.
    P = torch.exp(S - 3 * ln2)
    torch.testing.assert_close(P, torch.tensor([0.125, 0.25, 0.5, 0.125]))
    dS = P * (v - 2.375)
    printed_dS = torch.tensor([-0.171875, 0.40625, 0.3125, -0.546875])
    torch.testing.assert_close(dS, printed_dS, rtol=0, atol=1e-15)
    assert abs(dS.sum().item()) < 1e-15
    Sg = S.clone().requires_grad_()
    (dS_autograd,) = torch.autograd.grad(torch.softmax(Sg, 0) @ v, Sg)
    torch.testing.assert_close(dS_autograd, printed_dS, rtol=0, atol=1e-15)
    # The reference's tiled forward with tiles of two keys, the example embedded in head_dim 16 (s = 1/4).
    monkeypatch.setattr(flash_module, "TILE_SIZE", 2)
    q = torch.zeros(1, 4, 16, dtype=torch.float32)
    q[..., 0] = 4.0
    k, vv = torch.zeros_like(q), torch.zeros_like(q)
    k[0, :, 0], vv[0, :, 0] = S.float(), v.float()
    with torch.no_grad():
        o, L = flash_module._forward(q, k, vv, False)
    torch.testing.assert_close(o[0, :, 0], torch.full((4,), 2.375, dtype=torch.float32), rtol=0, atol=1e-6)
    torch.testing.assert_close(L[0], torch.full((4,), 3 * ln2, dtype=torch.float32), rtol=0, atol=1e-6)
    text = section_text("flash_attention_torch")
    for printed in ("$S = (0, ln 2 | 2 ln 2, 0)$, $v = (1, 4 | 3, -2)$", "$m = ln 2$, $ell = 0.5 + 1 = 1.5$",
                    "$a = 0.5 dot 1 + 1 dot 4 = 4.5$", "$alpha = 0.5$, $ell = 0.5 dot 1.5 + 1 + 0.25 = 2$",
                    "$a = 0.5 dot 4.5 + 3 + 0.25 dot (-2) = 4.75$", "$o = 2.375$", "$L = 2 ln 2 + ln 2 = 3 ln 2$",
                    "$e^S = (1, 2, 4, 1)$ sums to $8 = e^(3 ln 2)$", "$o = (1 + 8 + 12 - 2) \\/ 8$",
                    "$P = (0.125, 0.25, 0.5, 0.125)$", "$d S = (-0.171875, 0.40625, 0.3125, -0.546875)$"):
        assert printed in text, printed


def test_flash_self_check_answers():
    # (1) batch 1, 32 heads, n = 8192: L in float32, P in bf16.
    assert 32 * 8192 * 4 == 1 * MIB
    assert 32 * 8192**2 * 2 == 4 * GIB
    # (2) causal, n = 40, tiles of 16: pairs visited, and those crossing the diagonal.
    pairs = [(i0, i1, j0, j1) for i0, i1 in tiles(40, 16) for j0, j1 in tiles(i1, 16)]
    assert [sum(1 for p in pairs if p[0] == i0) for i0, _ in tiles(40, 16)] == [1, 2, 3]
    assert len(pairs) == 6
    assert sum(1 for i0, i1, j0, j1 in pairs if j1 - 1 > i0) == 3
    # (3) merging two states of disjoint key sets.
    gen = torch.Generator().manual_seed(2)
    scores, values = torch.randn(9, generator=gen) * 3, torch.randn(9, 2, generator=gen)

    def state(sc, va):
        m = sc.max()
        return m, torch.exp(sc - m).sum(), torch.exp(sc - m) @ va

    (m1, l1, a1), (m2, l2, a2) = state(scores[:4], values[:4]), state(scores[4:], values[4:])
    m = torch.maximum(m1, m2)
    ell = torch.exp(m1 - m) * l1 + torch.exp(m2 - m) * l2
    a = torch.exp(m1 - m) * a1 + torch.exp(m2 - m) * a2
    m_all, l_all, a_all = state(scores, values)
    torch.testing.assert_close((m, ell, a), (m_all, l_all, a_all), rtol=1e-13, atol=1e-13)
    # The section's intro: the n x n float32 scores at n = 32768.
    assert 32768**2 * 4 == 4 * GIB


# ---------------------------------------------------------------------------------------------------------------
# Row sum, softmax, analysis: self-check answers


def test_row_sum_self_check_answers():
    assert row_sum_torch(torch.zeros(4, 1, 7)).shape == (4, 1)
    assert row_sum_torch(torch.zeros(7)).shape == ()
    assert row_sum_torch(torch.zeros(3, 0, 5)).shape == (3, 0)
    total16, total32 = torch.tensor(0.0, dtype=torch.float16), torch.tensor(0.0, dtype=torch.float32)
    one16, one32 = torch.tensor(1.0, dtype=torch.float16), torch.tensor(1.0, dtype=torch.float32)
    for _ in range(10_000):
        total16, total32 = total16 + one16, total32 + one32
    assert total16.item() == 2048 and total32.item() == 10_000
    assert torch.tensor(2049.0).half().item() == 2048  # halfway between 2048 and 2050: to the even one
    assert 8192 * 4096 * 4 == 128 * MIB and 8192 * 4 == 32 * KIB
    assert 128 * MIB / 4.2e12 * 1e6 == pytest.approx(32, abs=0.5)


def test_softmax_self_check_answers():
    m1, s1 = 2.0, 1 + math.exp(-2)
    m2 = 4.0
    s2 = s1 * math.exp(m1 - m2) + 1 + math.exp(-3)
    assert (round(s1, 4), round(s2, 4), round(1 / s2, 4)) == (1.1353, 1.2034, 0.8310)
    y = softmax_torch(torch.tensor([2.0, 0, 4, 1]))
    assert y[2].item() == pytest.approx(1 / s2, rel=1e-12)
    # Padding lanes loaded as 0 instead of -inf: they win the max and add 2 e^0 to the sum.
    padded = torch.tensor([-5.0, -7, 0, 0])
    wrong = torch.exp(padded - padded.max()) / torch.exp(padded - padded.max()).sum()
    assert round(wrong[0].item(), 4) == 0.0034
    assert round(softmax_torch(torch.tensor([-5.0, -7]))[0].item(), 4) == 0.8808 == round(1 / (1 + math.exp(-2)), 4)


def test_analysis_self_check_answers_and_no_graded_answer_printed():
    assert round(0.25 / 0.35, 3) == 0.714
    flops = 2 * 64 * 64 * 1024
    traffic = (2 * 64 * 1024 + 64 * 64) * 4
    assert round(flops / traffic, 1) == 15.5
    loads = sum(i + 1 for i in range(1024 // 128))
    assert loads == 36 and loads / (1024 // 128) == 4.5
    # The graded answers (grader/kernels/test_analysis.py) are not given away by the section.
    graded_intensity = 2 * 128 * 128 * 4096 / ((128 * 4096 * 2) * 2 + 128 * 128 * 2)
    graded_blocks = sum(i + 1 for i in range(8192 // 128))
    text = section_text("analysis")
    for given_away in (f"{graded_intensity:.1f}", f"{graded_intensity:.2f}", str(graded_blocks), "4096 / 130",
                       "/ 130"):
        assert given_away not in text, given_away
