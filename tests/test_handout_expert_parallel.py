"""The expert-parallel section of the handout: the counts and splits it derives, its worked example, the gradients it
states and its self-check.

The section's formulas (c_r, S_rq, R_q, its row and column sums, the arrival order, the grouping by local expert)
are written out here from the routing alone and compared with what the reference's `expert_parallel_moe` actually
exchanges: its ranks run as threads of one process over a stand-in for `dist.all_to_all_single` that records every
call's split sizes and the rows it delivers. The layer's output and gradients are compared in float64 with the
reference's single-process `expert_parallel_moe_torch`, and the gate's gradient with the section's
<dL/dy_t, z_tj>. The worked example's printed numbers are hard-coded as the section prints them.
"""

from pathlib import Path

import pytest
import torch

import reference.parallel.expert_parallel as ep
from reference.parallel.expert_parallel import _expert, expert_parallel_moe_torch
from tests.thread_ranks import ThreadRanks

SECTION = Path(__file__).resolve().parents[1] / "assignment/handout/sections/parallel/expert_parallel.typ"

pytestmark = pytest.mark.usefixtures("float64_by_default")

# The worked example: rank r's token t goes to the experts ROUTING[r][t].
ROUTING = [[[3, 0], [1, 3], [0, 2]], [[2, 0], [1, 2], [3, 2]]]
EXPERTS = 4


class AllToAll(ThreadRanks):
    """dist.all_to_all_single for ranks run as threads of one process, recording every call's splits and rows (a
    collective with uneven splits, which `tests.thread_ranks.Collectives` does not have)."""

    def __init__(self, world):
        super().__init__(world)
        self.posted = [None] * world
        self.calls = [[] for _ in range(world)]

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None):
        rank, n = self.local.rank, self.world_size
        splits_in = input_split_sizes or [input.shape[0] // n] * n
        splits_out = output_split_sizes or [output.shape[0] // n] * n
        self.posted[rank] = input.clone().split(splits_in)
        self.barrier.wait()
        output.copy_(torch.cat([self.posted[source][rank] for source in range(n)]))
        self.calls[rank].append((list(splits_out), list(splits_in), output.clone()))
        self.barrier.wait()


def run_layer(monkeypatch, xs, indices, gates, w_in, w_out, experts):
    """expert_parallel_moe on every rank (threads), then y.backward(dy) on every rank; returns what each rank got."""
    n = len(xs)
    fake = AllToAll(n)
    monkeypatch.setattr(ep, "dist", fake)
    per = experts // n
    leaves = [[t.clone().requires_grad_() for t in (xs[r], gates[r], w_in[r * per:(r + 1) * per],
                                                       w_out[r * per:(r + 1) * per])] for r in range(n)]
    torch.manual_seed(1)
    grad_ys = [torch.randn_like(x) for x in xs]

    def run(r):
        x, g, wi, wo = leaves[r]
        y = ep.expert_parallel_moe(x, indices[r], g, wi, wo, experts)
        y.backward(grad_ys[r])
        return y.detach()

    return fake, leaves, fake.run(run), grad_ys


def counts(routing, experts):
    """c_r(e): rank r's assignments to expert e."""
    return [[sum(e == expert for token in routes for e in token) for expert in range(experts)] for routes in routing]


def section_formulas(routing, experts):
    """S_rq, R_q, receive splits (R_q's row sums), n_q (its column sums) and the arrival order, as the section says."""
    n = len(routing)
    per = experts // n
    c = counts(routing, experts)
    owned = [range(q * per, (q + 1) * per) for q in range(n)]
    s = [[sum(c[r][e] for e in owned[q]) for q in range(n)] for r in range(n)]
    received = [[[c[src][q * per + e] for e in range(per)] for src in range(n)] for q in range(n)]
    receive_splits = [[sum(row) for row in received[q]] for q in range(n)]
    rows_per_expert = [[sum(received[q][src][e] for src in range(n)) for e in range(per)] for q in range(n)]
    sorted_rows = []  # each rank's (token, expert), stably sorted by expert
    for routes in routing:
        assignments = [(t, e) for t, token in enumerate(routes) for e in token]
        sorted_rows.append(sorted(assignments, key=lambda a: a[1]))
    arrivals = [[(src, t, e) for src in range(n) for t, e in sorted_rows[src] if e // per == q] for q in range(n)]
    return c, s, received, receive_splits, rows_per_expert, sorted_rows, arrivals


def test_worked_example_numbers():
    c, s, received, receive_splits, rows_per_expert, sorted_rows, arrivals = section_formulas(ROUTING, EXPERTS)
    assert c == [[2, 1, 1, 2], [1, 1, 3, 1]]
    assert s == [[3, 3], [2, 4]]
    assert received == [[[2, 1], [1, 1]], [[1, 2], [3, 1]]]
    assert [row for row in s] == [[3, 3], [2, 4]]  # send splits: rows of S
    assert receive_splits == [[3, 2], [3, 4]]  # receive splits: columns of S
    assert [sum(x) for x in receive_splits] == [5, 7]
    assert sum(map(sum, receive_splits)) == sum(len(token) for routes in ROUTING for token in routes)
    expert_of = [e for token in ROUTING[0] for e in token]
    perm = sorted(range(6), key=lambda a: expert_of[a])
    assert perm == [1, 4, 2, 5, 0, 3]
    assert [a // 2 for a in perm] == [0, 2, 1, 2, 0, 1]
    local = [e - 2 for _, _, e in arrivals[1]]
    assert local == [0, 1, 1, 0, 0, 0, 1]
    assert sorted(range(7), key=lambda i: local[i]) == [0, 3, 4, 5, 1, 2, 6]
    assert rows_per_expert[1] == [4, 3]
    text = " ".join(SECTION.read_text().split())
    for printed in ("S = mat(3, 3; 2, 4), quad R_0 = mat(2, 1; 1, 1), quad R_1 = mat(1, 2; 3, 1)",
                    "Rank 0 sends splits $(3, 3)$ and receives $(3, 2)$, 5 rows; rank 1 sends $(2, 4)$ and receives "
                    "$(3, 4)$, 7 rows; 12 $= N T k$",
                    "$\"perm\" = (1, 4, 2, 5, 0, 3)$ and the tokens are $(0, 2, 1, 2, 0, 1)$",
                    "the local experts $(0, 1, 1, 0, 0, 0, 1)$, grouped by $(0, 3, 4, 5, 1, 2, 6)$",
                    "$n_1 (0) = 4$ rows and $e_3$ on $n_1 (1) = 3$"):
        assert printed in text, printed


def test_reference_exchanges_what_the_section_derives(monkeypatch):
    c, s, received, receive_splits, rows_per_expert, sorted_rows, arrivals = section_formulas(ROUTING, EXPERTS)
    n, d, h, k = 2, 1, 3, 2
    # Each token's single feature names it: 10 r + t, so the rows a rank receives show where they came from.
    xs = [torch.tensor([[10.0 * r + t] for t in range(3)]) for r in range(n)]
    indices = [torch.tensor(routes) for routes in ROUTING]
    torch.manual_seed(0)
    gates = [torch.rand(3, k) for _ in range(n)]
    w_in, w_out = torch.randn(EXPERTS, d, h), torch.randn(EXPERTS, h, d)
    fake, _, _, _ = run_layer(monkeypatch, xs, indices, gates, w_in, w_out, EXPERTS)
    for q in range(n):
        (count_out, _, got_counts), (dispatch_out, dispatch_in, rows), (combine_out, combine_in, back) = \
            fake.calls[q][:3]
        assert got_counts.view(n, -1).tolist() == received[q]
        assert dispatch_in == s[q] and dispatch_out == receive_splits[q]
        assert combine_in == receive_splits[q] and combine_out == s[q]  # the same exchange, splits swapped
        assert rows[:, 0].tolist() == [10.0 * src + t for src, t, _ in arrivals[q]]  # source-major, then expert
        assert back.shape[0] == sum(s[q]) == 3 * k  # its own T k results
        # The backward: the same exchanges again, each with input and output splits swapped.
        backward = fake.calls[q][3:]
        assert [(o, i) for o, i, _ in backward] == [(receive_splits[q], s[q]), (s[q], receive_splits[q])]


@pytest.mark.parametrize("n, experts, tokens", [(2, 4, (3, 3)), (2, 4, (5, 0)), (4, 8, (4, 6, 1, 5))])
def test_layer_and_gradients_match_one_process(monkeypatch, n, experts, tokens):
    torch.manual_seed(n + experts)
    d, h, k = 3, 4, 2
    xs = [torch.randn(t, d) for t in tokens]
    indices = [torch.stack([torch.randperm(experts)[:k] for _ in range(t)]) if t else torch.zeros(0, k,
               dtype=torch.long) for t in tokens]
    gates = [torch.rand(t, k) for t in tokens]
    w_in, w_out = torch.randn(experts, d, h), torch.randn(experts, h, d)
    _, leaves, outputs, grad_ys = run_layer(monkeypatch, xs, indices, gates, w_in, w_out, experts)

    x, g = torch.cat(xs).requires_grad_(), torch.cat(gates).requires_grad_()
    wi, wo = w_in.clone().requires_grad_(), w_out.clone().requires_grad_()
    y = expert_parallel_moe_torch(x, torch.cat(indices), g, wi, wo)
    y.backward(torch.cat(grad_ys))
    assert torch.allclose(torch.cat(outputs), y.detach(), atol=1e-12)
    assert torch.allclose(torch.cat([leaf[0].grad for leaf in leaves]), x.grad, atol=1e-12)
    assert torch.allclose(torch.cat([leaf[1].grad for leaf in leaves]), g.grad, atol=1e-12)
    assert torch.allclose(torch.cat([leaf[2].grad for leaf in leaves]), wi.grad, atol=1e-12)
    assert torch.allclose(torch.cat([leaf[3].grad for leaf in leaves]), wo.grad, atol=1e-12)
    # dL/dg_tj = <dL/dy_t, z_tj>, z_tj = expert_(e_tj)(x_t): the section's gate gradient.
    dy, index = torch.cat(grad_ys), torch.cat(indices)
    z = torch.stack([torch.stack([_expert(x[t:t + 1].detach(), w_in[e], w_out[e])[0] for e in index[t].tolist()])
                     for t in range(x.shape[0])]) if x.shape[0] else torch.zeros(0, k, d)
    assert torch.allclose((dy[:, None, :] * z).sum(-1), g.grad, atol=1e-12)


def test_self_check_traffic_and_splits(monkeypatch):
    """N = 8, E = 64, k = 2, T = 4096 tokens of D = 4096 bf16 values, routing uniform: measured on the reference with
    T = 32 tokens per rank, whose 64 assignments go to the 64 experts once each, then scaled by 4096 / 32."""
    n, experts, k, tokens, d = 8, 64, 2, 32, 1
    scale = 4096 // tokens
    generator = torch.Generator().manual_seed(0)
    indices = [torch.randperm(experts, generator=generator).view(tokens, k) for _ in range(n)]
    xs, gates = [torch.randn(tokens, d) for _ in range(n)], [torch.rand(tokens, k) for _ in range(n)]
    fake, _, _, _ = run_layer(monkeypatch, xs, indices, gates, torch.randn(experts, d, 1), torch.randn(experts, 1, d),
                              experts)
    rows = [sum(dispatch_in) for (_, _, _), (_, dispatch_in, _), *_ in fake.calls]
    to_others = [sum(dispatch_in) - dispatch_in[q] for q, (_, (_, dispatch_in, _), *_) in enumerate(fake.calls)]
    assert {r * scale for r in rows} == {8192} and {r * scale for r in to_others} == {7168}
    assert to_others[0] * scale * 4096 * torch.bfloat16.itemsize == 58_720_256
    counts = {(call[0][2].numel() * call[0][2].element_size()) for call in fake.calls}
    assert counts == {512}
    # All of a rank's tokens on its own experts: T k rows to itself, none elsewhere.
    routing = [[[0, 1], [1, 0], [0, 1]], [[2, 3], [0, 3], [1, 2]]]
    _, s, *_ = section_formulas(routing, 4)
    assert s[0] == [3 * 2, 0]
    text = " ".join(SECTION.read_text().split())
    for printed in ("(1) 7168 of the $T k = 8192$ rows: $7168 dot 4096 dot 2 = 58 thin 720 thin 256$ bytes (56~MiB)",
                    "64 int64, 512 bytes", "(2) $T k$ to itself, 0 elsewhere"):
        assert printed in text, printed
