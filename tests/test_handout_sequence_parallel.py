"""The sequence-parallelism section of the handout: its reduce-scatter, its backward rules, its layout example,
Algorithm 1 and its self-check.

The section's formulas are implemented here in float64 with the ranks' pieces computed one after the other in one
process: the reduce-scatter as the slice of a sum over ranks (and, followed by the all-gather, the all-reduce), the
backward of the gather (a reduce-scatter) and of the reduce-scatter (an all-gather) against autograd, and Algorithm 1
against the reference's single-rank `mlp_block_torch`, the replicated parameters' gradients summing to the single-rank
ones. The reference's own functions and block run on N ranks simulated by threads of this process, the collectives
they issue done in memory (no process group, no spawn): the layout example's printed numbers, the block's outputs and
gradients and its collectives are checked. The self-check's byte counts come from `reference.parallel.accounting`.
"""

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from reference.parallel.accounting import communication_volume, transformer_layer_activations
from reference.parallel.sequence_parallel import (
    SequenceParallelMLPBlock,
    gather_sequence,
    mlp_block_torch,
    reduce_scatter_sequence,
)
from tests.thread_ranks import Collectives, bytes_sent_per_rank

pytestmark = pytest.mark.usefixtures("float64_by_default")


def own_tokens(x, r, n):
    """Rank r's tokens [r t, (r + 1) t) of every sequence of a [B, T, D] tensor."""
    t = x.shape[1] // n
    return x[:, r * t : (r + 1) * t]


@pytest.mark.parametrize("n", [2, 4])
def test_reduce_scatter_is_the_slice_of_the_sum_and_then_all_gather_is_the_all_reduce(n):
    torch.manual_seed(n)
    partials = [torch.randn(2, 4 * n, 3) for _ in range(n)]
    total = sum(partials)  # what g's all-reduce gives every rank
    reduced = [sum(own_tokens(p, r, n) for p in partials) for r in range(n)]  # y_r = sum_q P_q[:, rt:(r+1)t]
    for r in range(n):
        assert torch.equal(reduced[r], own_tokens(total, r, n))
    assert torch.equal(torch.cat(reduced, dim=1), total)
    # The same number of bytes: an all-gather and a reduce-scatter are together one all-reduce.
    size = total.numel() * 2
    assert (communication_volume("all_gather", size, n) + communication_volume("reduce_scatter", size, n)
            == communication_volume("all_reduce", size, n))


@pytest.mark.parametrize("n", [2, 3])
def test_backward_of_gather_is_reduce_scatter_and_of_reduce_scatter_is_all_gather(n):
    torch.manual_seed(n)
    b, t, d = 2, 2, 3
    # Gather: every rank q computes its own function of its copy of the gathered X.
    shards = [torch.randn(b, t, d, requires_grad=True) for _ in range(n)]
    copies = [torch.cat(shards, dim=1) for _ in range(n)]
    for c in copies:
        c.retain_grad()
    weights = [torch.randn(d, d) for _ in range(n)]
    sum((torch.tanh(c @ w)).sum() for c, w in zip(copies, weights)).backward()
    for r in range(n):
        by_formula = sum(own_tokens(c.grad, r, n) for c in copies)  # sum_q (dL/dX^(q))[:, rt:(r+1)t]
        torch.testing.assert_close(shards[r].grad, by_formula, rtol=1e-12, atol=1e-12)
    # Reduce-scatter: y_r = sum_q P_q[:, rt:(r+1)t]; every P_q's gradient is the all-gather of the dL/dy_r.
    partials = [torch.randn(b, n * t, d, requires_grad=True) for _ in range(n)]
    outs = [sum(own_tokens(p, r, n) for p in partials) for r in range(n)]
    for o in outs:
        o.retain_grad()
    sum((torch.sin(o) * (r + 1)).sum() for r, o in enumerate(outs)).backward()
    gathered = torch.cat([o.grad for o in outs], dim=1)
    for p in partials:
        torch.testing.assert_close(p.grad, gathered, rtol=1e-12, atol=1e-12)


def test_layout_example_as_printed(monkeypatch):
    n, b, t = 2, 2, 2
    x = torch.tensor([[[10.0 * s + tau] for tau in range(4)] for s in range(b)])  # token (b, tau) holds 10 b + tau
    shards = [own_tokens(x, r, n) for r in range(n)]
    assert [s[..., 0].tolist() for s in shards] == [[[0, 1], [10, 11]], [[2, 3], [12, 13]]]
    rank_major = torch.cat(shards, dim=0)  # what all_gather_into_tensor returns: [N B, t, D]
    assert rank_major[..., 0].tolist() == [[0, 1], [10, 11], [2, 3], [12, 13]]
    assert rank_major.reshape(b, 4, 1)[..., 0].tolist() == [[0, 1, 10, 11], [2, 3, 12, 13]]  # read directly: wrong
    fixed = rank_major.unflatten(0, (n, b)).transpose(0, 1).reshape(b, 4, 1)
    assert fixed[..., 0].tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]
    # The reference's own functions on two simulated ranks; partial sums P_q = x + 100 q.
    ranks = Collectives(n, monkeypatch)
    results = ranks.run(lambda r: (gather_sequence(shards[r]), reduce_scatter_sequence(x + 100 * r)))
    assert all(torch.equal(gathered, x) for gathered, _ in results)
    assert [scattered[..., 0].tolist() for _, scattered in results] == [[[100, 102], [120, 122]],
                                                                        [[104, 106], [124, 126]]]
    assert ranks.calls == [("all_gather", b * t), ("reduce_scatter", b * 2 * t)]


def make_block(d=4, hidden=8, seed=0):
    torch.manual_seed(seed)
    norm = torch.nn.LayerNorm(d)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(d))
        norm.bias.copy_(0.2 * torch.randn(d))
    return norm, torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)


def keep_mask(shape, p, seed):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32) >= p


@pytest.mark.parametrize("n", [2, 4])
def test_algorithm_one_matches_the_single_rank_block_and_replicated_gradients_sum(n):
    b, t, p, seed = 2, 2, 0.25, 7
    norm, fc1, fc2 = make_block(seed=n)
    x = torch.randn(b, n * t, 4)
    keep = keep_mask(x.shape, p, seed)
    # Each rank its own copy of the replicated norm and fc2 bias, so that each accumulates its own gradient.
    norms = [copy.deepcopy(norm) for _ in range(n)]
    biases = [fc2.bias.detach().clone().requires_grad_() for _ in range(n)]
    xs = [own_tokens(x, r, n).clone().requires_grad_() for r in range(n)]
    gathered = torch.cat([norms[r](xs[r]) for r in range(n)], dim=1)  # steps 1 and 2
    partials = []
    for r in range(n):  # step 3, rank r's hidden slice
        rows = slice(r * 8 // n, (r + 1) * 8 // n)
        z = F.gelu(gathered @ fc1.weight[rows].T + fc1.bias[rows])
        partials.append(z @ fc2.weight[:, rows].T)
    outs = []
    for r in range(n):  # steps 4 and 5
        s = sum(own_tokens(q, r, n) for q in partials)
        outs.append(xs[r] + (s + biases[r]) * own_tokens(keep, r, n) / (1 - p))
    y = torch.cat(outs, dim=1)
    upstream = torch.randn_like(y)
    (y * upstream).sum().backward()
    # The single-rank block, and its gradients.
    xf = x.clone().requires_grad_()
    params = [norm.weight, norm.bias, fc1.weight, fc1.bias, fc2.weight, fc2.bias]
    expected = mlp_block_torch(xf, norm.weight, norm.bias, norm.eps, fc1.weight, fc1.bias, fc2.weight, fc2.bias,
                               p, seed)
    (expected * upstream).sum().backward()
    torch.testing.assert_close(y, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([xr.grad for xr in xs], dim=1), xf.grad, rtol=1e-12, atol=1e-12)
    # Step 6: each rank's replicated gradient is a partial sum over its tokens; the sum over ranks is complete.
    assert not torch.allclose(norms[0].weight.grad, norm.weight.grad)
    torch.testing.assert_close(sum(m.weight.grad for m in norms), params[0].grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sum(m.bias.grad for m in norms), params[1].grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sum(bias.grad for bias in biases), params[5].grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [2, 4])
def test_reference_block_on_simulated_ranks(monkeypatch, n):
    """Outputs, input and parameter gradients against the single-rank block; per forward one all-gather and one
    reduce-scatter, per backward the same two in the other order, then one all-reduce of the replicated gradients."""
    b, t, d, p, seed = 2, 2, 4, 0.25, 3
    norm, fc1, fc2 = make_block(d=d, seed=10 + n)
    x = torch.randn(b, n * t, d)
    upstream = torch.randn(b, n * t, d)
    ranks = Collectives(n, monkeypatch)

    def program(rank):
        block = SequenceParallelMLPBlock(norm, fc1, fc2, p)
        xr = own_tokens(x, rank, n).clone().requires_grad_()
        y = block(xr, seed=seed)
        (y * own_tokens(upstream, rank, n)).sum().backward()
        block.all_reduce_replicated_gradients()
        return y.detach(), xr.grad, {k: v.grad for k, v in block.named_parameters()}

    results = ranks.run(program)
    xf = x.clone().requires_grad_()
    expected = mlp_block_torch(xf, norm.weight, norm.bias, norm.eps, fc1.weight, fc1.bias, fc2.weight, fc2.bias,
                               p, seed)
    (expected * upstream).sum().backward()
    torch.testing.assert_close(torch.cat([r[0] for r in results], dim=1), expected.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat([r[1] for r in results], dim=1), xf.grad, rtol=1e-10, atol=1e-10)
    hidden = fc1.out_features // n
    for rank, (_, _, grads) in enumerate(results):
        rows = slice(rank * hidden, (rank + 1) * hidden)
        for name, full in (("norm.weight", norm.weight.grad), ("norm.bias", norm.bias.grad),
                           ("fc2.bias", fc2.bias.grad), ("fc1.weight", fc1.weight.grad[rows]),
                           ("fc1.bias", fc1.bias.grad[rows]), ("fc2.weight", fc2.weight.grad[:, rows])):
            torch.testing.assert_close(grads[name], full, rtol=1e-10, atol=1e-10)
    local, full = b * t * d, b * n * t * d
    assert ranks.calls == [("all_gather", local), ("reduce_scatter", full), ("all_gather", local),
                           ("reduce_scatter", full), ("all_reduce", 3 * d)]


SECTION = Path(__file__).resolve().parents[1] / "assignment/handout/sections/parallel/sequence_parallel.typ"


def test_self_check_bytes_and_activation_memory(monkeypatch):
    """B = 4, T = 2048, D = 4096, bf16, N = 4: the reference block's forward collectives, logged on 4 simulated ranks
    with T = 8, D = 4, and the bytes each sends, measured on the reference's ring collectives; both scaled, every
    count being linear in T D."""
    b, t, d, n = 4, 8, 4, 4
    scale = 2048 * 4096 // (t * d)
    norm, fc1, fc2 = make_block(d=d)
    ranks = Collectives(n, monkeypatch)
    ranks.run(lambda rank: SequenceParallelMLPBlock(norm, fc1, fc2, 0.0)(torch.randn(b, t // n, d), seed=0))
    (gather, local), (scatter, full) = ranks.calls
    assert (gather, scatter) == ("all_gather", "reduce_scatter")
    item = torch.bfloat16.itemsize
    assert (local * scale * item, full * scale * item) == (16_777_216, 67_108_864)  # a norm-region activation: 1 / N
    sent = [bytes_sent_per_rank(monkeypatch, name, n, full, torch.bfloat16) * scale for name in (gather, scatter)]
    assert sent == [50_331_648, 50_331_648] and sum(sent) == 100_663_296
    # With tensor parallelism alone, one all-reduce of the same [B, T, D], the same bytes.
    assert bytes_sent_per_rank(monkeypatch, "all_reduce", n, full, torch.bfloat16) * scale == sum(sent)
    assert sent == [communication_volume(c, full * scale * item, n) for c in ("all_gather", "reduce_scatter")]
    # The norm region's activations shrink N-fold (the accounting problem's LayerNorm term, 4 sbh bytes per layer).
    plain = transformer_layer_activations(2048, 4, 4096, 32, tensor_parallel=4)
    split = transformer_layer_activations(2048, 4, 4096, 32, tensor_parallel=4, sequence_parallel=True)
    assert plain.layernorm == 4 * split.layernorm == 4 * full * scale * item // 2
    text = " ".join(SECTION.read_text().split())
    for printed in ("sends $50 thin 331 thin 648$ bytes", "($3 slash 4$ of $67 thin 108 thin 864$)",
                    "$100 thin 663 thin 296$", "$16 thin 777 thin 216$ bytes instead of $67 thin 108 thin 864$"):
        assert printed in text, printed
