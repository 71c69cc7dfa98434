"""The tensor-parallelism section of the handout: its split products, its MLP algorithm and its worked example.

The column and row splits of a linear layer, their backward rules and Algorithm 1 (the MLP with fc1 column-parallel
and fc2 row-parallel, one all-reduce each way) are implemented here in float64 as the section writes them, with the
ranks' pieces computed one after the other and summed where the section all-reduces; they are compared with the
reference's single-rank `mlp_torch` and its autograd. The reference's own layers run on N ranks simulated by threads
of this process, the collectives they issue done in memory (no process group, no spawn): their shards, outputs,
input gradients and collectives are checked against the section. The worked example's printed numbers and the
self-check's answers are recomputed.
"""

import math
from pathlib import Path

import pytest
import torch

from reference.parallel.accounting import communication_volume
from reference.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelAttention,
    TensorParallelMLP,
    attention_torch,
    mlp_torch,
)
from tests.thread_ranks import Collectives, bytes_sent_per_rank

pytestmark = pytest.mark.usefixtures("float64_by_default")


def gelu(h):
    return 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))


def gelu_derivative(h):
    """GeLU'(h) = Phi(h) + h phi(h)."""
    return 0.5 * (1 + torch.erf(h / math.sqrt(2))) + h * torch.exp(-h * h / 2) / math.sqrt(2 * math.pi)


def rows_of(w, r, n):
    return w.chunk(n, dim=0)[r]


def columns_of(w, r, n):
    return w.chunk(n, dim=1)[r]


def test_column_and_row_splits_and_their_backward_rules():
    torch.manual_seed(0)
    n, x, w, dy = 3, torch.randn(5, 6), torch.randn(9, 6), torch.randn(5, 9)
    # Column-parallel: output column blocks side by side; dX = sum_r dY_r W_r, a sum over ranks.
    assert torch.allclose(torch.cat([x @ rows_of(w, r, n).T for r in range(n)], dim=1), x @ w.T)
    assert torch.allclose(sum(dy.chunk(n, dim=1)[r] @ rows_of(w, r, n) for r in range(n)), dy @ w)
    # Row-parallel: the inner dimension split, a sum of partial products; dX_r = dY W^(r), dW^(r) = dY^T X_r.
    w_row = torch.randn(4, 6)
    assert torch.allclose(sum(x.chunk(n, dim=1)[r] @ columns_of(w_row, r, n).T for r in range(n)), x @ w_row.T)
    dy_row = torch.randn(5, 4)
    assert torch.allclose(torch.cat([dy_row @ columns_of(w_row, r, n) for r in range(n)], dim=1), dy_row @ w_row)
    assert torch.allclose(torch.cat([dy_row.T @ x.chunk(n, dim=1)[r] for r in range(n)], dim=1), dy_row.T @ x)


def algorithm_one(x, w1, b1, w2, b2, dy, n, act=gelu, act_derivative=gelu_derivative, f_backward=True):
    """Algorithm 1 on n ranks, one after the other: (Y, dX, per-rank partial products P_r and partial dX_r)."""
    partials, h = [], []
    for r in range(n):
        h.append(x @ rows_of(w1, r, n).T + (0 if b1 is None else rows_of(b1, r, n)))
        partials.append(act(h[r]) @ columns_of(w2, r, n).T)
    y = sum(partials) + (0 if b2 is None else b2)  # g: all-reduce, then the replicated bias once
    dx_parts = []
    for r in range(n):
        dz = dy @ columns_of(w2, r, n)  # the same dY on every rank
        dh = dz * act_derivative(h[r])
        dx_parts.append(dh @ rows_of(w1, r, n))
    dx = sum(dx_parts) if f_backward else None  # f's backward: all-reduce
    return y, dx, partials, dx_parts


@pytest.mark.parametrize("n", [1, 2, 4])
def test_algorithm_one_matches_the_single_rank_mlp_and_its_autograd(n):
    torch.manual_seed(n)
    d, f, rows = 6, 8, 5
    x = torch.randn(rows, d, requires_grad=True)
    w1, b1, w2, b2 = torch.randn(f, d), torch.randn(f), torch.randn(d, f), torch.randn(d)
    dy = torch.randn(rows, d)
    y, dx, _, _ = algorithm_one(x.detach(), w1, b1, w2, b2, dy, n)
    expected = mlp_torch(x, w1, b1, w2, b2)
    expected.backward(dy)
    torch.testing.assert_close(y, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, x.grad, rtol=1e-12, atol=1e-12)


def relu_derivative(h):
    return (h > 0).to(h.dtype)


WORKED_W1 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
WORKED_W2 = torch.tensor([[1.0, 1.0, 0.0, 2.0], [0.0, 1.0, 1.0, -1.0]], dtype=torch.float64)
WORKED_X = torch.tensor([[1.0, 2.0]], dtype=torch.float64)


def test_worked_example_as_printed():
    y, dx, partials, dx_parts = algorithm_one(WORKED_X, WORKED_W1, None, WORKED_W2, None, torch.ones(1, 2), 2,
                                              act=torch.relu, act_derivative=relu_derivative)
    h = [WORKED_X @ rows_of(WORKED_W1, r, 2).T for r in range(2)]
    assert [t[0].tolist() for t in h] == [[1, 2], [3, -1]]
    assert [torch.relu(t)[0].tolist() for t in h] == [[1, 2], [3, 0]]
    assert [p[0].tolist() for p in partials] == [[3, 2], [0, 3]]
    assert y[0].tolist() == [3, 5]
    z = torch.relu(WORKED_X @ WORKED_W1.T)
    assert z[0].tolist() == [1, 2, 3, 0] and (z @ WORKED_W2.T)[0].tolist() == [3, 5]
    dz = [torch.ones(1, 2) @ columns_of(WORKED_W2, r, 2) for r in range(2)]
    assert [t[0].tolist() for t in dz] == [[1, 2], [1, 1]]
    assert (dz[1] * relu_derivative(h[1]))[0].tolist() == [1, 0]
    assert [t[0].tolist() for t in dx_parts] == [[1, 2], [1, 1]]
    assert dx[0].tolist() == [2, 3]
    dz_full = (torch.ones(1, 2) @ WORKED_W2) * relu_derivative(WORKED_X @ WORKED_W1.T)
    assert dz_full[0].tolist() == [1, 2, 1, 0] and (dz_full @ WORKED_W1)[0].tolist() == [2, 3]
    # Self-check 3: without f's all-reduce rank 1 keeps its own partial; an all-reduce in g's backward doubles dY.
    assert dx_parts[1][0].tolist() == [1, 1]
    _, doubled, _, _ = algorithm_one(WORKED_X, WORKED_W1, None, WORKED_W2, None, 2 * torch.ones(1, 2), 2,
                                     act=torch.relu, act_derivative=relu_derivative)
    assert doubled[0].tolist() == [4, 6]


def test_reference_layers_on_the_worked_example(monkeypatch):
    """The reference's column and row layers, ReLU between them, on two simulated ranks: Y = (3, 5), dX = (2, 3),
    one all-reduce of [B, D] in forward (g) and one in backward (f)."""
    ranks = Collectives(2, monkeypatch)
    fc1, fc2 = torch.nn.Linear(2, 4, bias=False), torch.nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        fc1.weight.copy_(WORKED_W1)
        fc2.weight.copy_(WORKED_W2)

    def program(rank):
        column, row = ColumnParallelLinear(fc1), RowParallelLinear(fc2)
        x = WORKED_X.clone().requires_grad_()
        y = row(torch.relu(column(x)))
        y.sum().backward()
        return column.weight.detach(), row.weight.detach(), y.detach(), x.grad

    results = ranks.run(program)
    assert [r[0].tolist() for r in results] == [[[1, 0], [0, 1]], [[1, 1], [1, -1]]]
    assert [r[1].tolist() for r in results] == [[[1, 1], [0, 1]], [[0, 2], [1, -1]]]
    assert all(r[2][0].tolist() == [3, 5] and r[3][0].tolist() == [2, 3] for r in results)
    assert ranks.calls == [("all_reduce", 2), ("all_reduce", 2)]


@pytest.mark.parametrize("n", [2, 4])
def test_reference_mlp_and_attention_one_all_reduce_each_way(monkeypatch, n):
    torch.manual_seed(n)
    batch, tokens, d, f, heads = 2, 3, 8, 16, 4
    fc1, fc2 = torch.nn.Linear(d, f), torch.nn.Linear(f, d)
    qkv, proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
    x = torch.randn(batch, tokens, d)
    ranks = Collectives(n, monkeypatch)

    def program(rank):
        results = []
        for module in (TensorParallelMLP(fc1, fc2), TensorParallelAttention(qkv, proj, heads, causal=True)):
            xr = x.clone().requires_grad_()
            out = module(xr)
            out.sum().backward()
            results.append((out.detach(), xr.grad, dict(module.named_parameters())))
        return results

    results = ranks.run(program)
    xs = x.clone().requires_grad_()
    mlp = mlp_torch(xs, fc1.weight, fc1.bias, fc2.weight, fc2.bias)
    mlp.sum().backward()
    mlp_grad, xs.grad = xs.grad, None
    attention = attention_torch(xs, qkv.weight, qkv.bias, proj.weight, proj.bias, heads, causal=True)
    attention.sum().backward()
    for r, ((y_mlp, dx_mlp, p_mlp), (y_att, dx_att, p_att)) in enumerate(results):
        torch.testing.assert_close(y_mlp, mlp.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(dx_mlp, mlp_grad, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(y_att, attention.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(dx_att, xs.grad, rtol=1e-10, atol=1e-10)
        # Shapes per rank, and the qkv shard: rank r's rows of each of the q, k and v blocks, in that order.
        assert {k: tuple(v.shape) for k, v in p_mlp.items()} == {
            "fc1.weight": (f // n, d), "fc1.bias": (f // n,), "fc2.weight": (d, f // n), "fc2.bias": (d,)}
        blocks = qkv.weight.split(d)
        assert torch.equal(p_att["qkv.weight"], torch.cat([rows_of(b, r, n) for b in blocks]))
        assert torch.equal(p_att["proj.weight"], columns_of(proj.weight, r, n))
    # Per module: one all-reduce of [B, T, D] in forward (g), one in backward (f).
    assert ranks.calls == [("all_reduce", batch * tokens * d)] * 4


SECTION = Path(__file__).resolve().parents[1] / "assignment/handout/sections/parallel/tensor_parallel.typ"


def test_self_check_bytes_and_shapes(monkeypatch):
    """B T = 8192 tokens, D = 4096, bf16, N = 8: the reference MLP's collectives per step, logged on 8 simulated ranks
    with 8 tokens of D = 8 (a multiple of N, as 8192 * 4096 is), and the bytes a ring all-reduce of them sends,
    measured on the reference's ring collectives; both scaled, every count being linear in the tokens' size."""
    tokens, d, world_size = 8, 8, 8
    scale = 8192 * 4096 // (tokens * d)
    ranks = Collectives(world_size, monkeypatch)
    fc1, fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def program(rank):
        x = torch.randn(tokens, d, requires_grad=True)
        TensorParallelMLP(fc1, fc2)(x).sum().backward()

    ranks.run(program)
    assert ranks.calls == [("all_reduce", tokens * d)] * 2  # g in forward, f in backward
    payload = tokens * d * scale * torch.bfloat16.itemsize
    sent = sum(bytes_sent_per_rank(monkeypatch, name, world_size, numel, torch.bfloat16) for name, numel in ranks.calls)
    assert (payload, sent * scale) == (67_108_864, 234_881_024)
    assert sent * scale == 2 * communication_volume("all_reduce", payload, world_size)
    ranks = Collectives(4, monkeypatch)
    fc1 = torch.nn.Linear(1024, 4096, device="meta")
    fc2 = torch.nn.Linear(4096, 1024, device="meta")
    shapes = ranks.run(lambda r: {k: tuple(v.shape) for k, v in TensorParallelMLP(fc1, fc2).named_parameters()})
    assert all(s == {"fc1.weight": (1024, 1024), "fc1.bias": (1024,), "fc2.weight": (1024, 1024),
                     "fc2.bias": (1024,)} for s in shapes)
    text = " ".join(SECTION.read_text().split())
    for printed in ("$8192 dot 4096 dot 2 = 67 thin 108 thin 864$", "$234 thin 881 thin 024$",
                    "$[1024, 1024]$, $[1024]$, $[1024, 1024]$, $[1024]$", "(3) $(1, 1)$", "$dif X = (4, 6)$"):
        assert printed in text, printed
