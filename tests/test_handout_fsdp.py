"""The FSDP section of the handout: its shard layout, its gradient formula, its worked example and its self-check.

The layout (N_pad = W ceil(N / W), rank r keeping elements [rS, (r + 1)S)) and the gradient formula
(dL/dtheta_r = 1/W sum_q G_q[rS : (r + 1)S]) are implemented here as the section writes them, in float64, and compared
with single-process training on the full batch. The reference's own `FSDP` runs on W ranks simulated by threads of
this process, with the collectives it issues done in memory (no process group, no spawn): its shards, its shard
gradients, the collectives of one step and the freeing of the gathered storage are checked against the section, and
the worked example's printed numbers are recomputed both ways. The self-check's byte counts come from
`reference.parallel.accounting`.
"""

import copy
import math
from pathlib import Path

import pytest
import torch

from reference.parallel.accounting import bytes_per_parameter, communication_volume
from reference.parallel.fsdp import FSDP
from tests.thread_ranks import Collectives, bytes_sent_per_rank


def example_unit():
    """The worked example's unit: Linear(2, 3), weight rows (1, 2), (3, 4), (5, 6), bias (7, 8, 9)."""
    linear = torch.nn.Linear(2, 3)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
        linear.bias.copy_(torch.tensor([7.0, 8.0, 9.0]))
    return linear


EXAMPLE_ROWS = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -2.0]])]


def padded_flat(tensors, world_size):
    """The section's layout: concatenate reshape(-1), pad with zeros to N_pad = W ceil(N / W); (flat, S)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    padded = world_size * math.ceil(flat.numel() / world_size)
    return torch.cat([flat, flat.new_zeros(padded - flat.numel())]), padded // world_size


def flat_gradient(module, theta, x, loss):
    """G = dL/dtheta for one rank: the module's trainable parameters replaced by views of the flat theta."""
    names, params = zip(*module.named_parameters())
    flat = theta.clone().requires_grad_()
    views = flat[: sum(p.numel() for p in params)].split([p.numel() for p in params])
    named = {name: view.view_as(p) for name, p, view in zip(names, params, views)}
    loss(torch.func.functional_call(module, named, (x,))).backward()
    return flat.grad


def run_reference(monkeypatch, world_size, make_model, rows_of, loss_of):
    """The reference FSDP on simulated ranks: (shards before the step, shard grads, the step's collectives, whether
    every unit's gathered storage was empty after forward and after backward)."""
    ranks = Collectives(world_size, monkeypatch)

    def program(rank):
        model = FSDP(make_model())
        shards = [p.detach().clone() for p in model.sharded_parameters()]
        out = model(rows_of(rank))
        freed = [unit.gathered.untyped_storage().nbytes() == 0 for unit in model.units]
        loss_of(out, rank).backward()
        freed += [unit.gathered.untyped_storage().nbytes() == 0 for unit in model.units]
        return shards, [p.grad.clone() for p in model.sharded_parameters()], all(freed)

    results = ranks.run(program)
    return [r[0] for r in results], [r[1] for r in results], ranks.calls, [r[2] for r in results]


def test_worked_example_layout_and_gradients_as_printed(monkeypatch):
    theta, shard = padded_flat([example_unit().weight.detach(), example_unit().bias.detach()], 2)
    assert theta.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0] and shard == 5
    # G_r: dL_r/dw_ij = x_j, dL_r/db_i = 1, padding 0, as printed, and by autograd through views of theta.
    grads = [torch.cat([x[0].repeat(3), torch.ones(3), torch.zeros(1)]) for x in EXAMPLE_ROWS]
    for g, x in zip(grads, EXAMPLE_ROWS):
        assert torch.equal(flat_gradient(example_unit(), theta, x, lambda y: y.sum()), g)
    assert grads[0].tolist() == [1, 2, 1, 2, 1, 2, 1, 1, 1, 0]
    assert grads[1].tolist() == [3, -2, 3, -2, 3, -2, 1, 1, 1, 0]
    average = (grads[0] + grads[1]) / 2
    assert average.tolist() == [2, 0, 2, 0, 2, 0, 1, 1, 1, 0]
    # The same from the reference, run on two simulated ranks.
    shards, shard_grads, calls, freed = run_reference(
        monkeypatch, 2, lambda: torch.nn.Sequential(example_unit()), lambda r: EXAMPLE_ROWS[r], lambda y, r: y.sum())
    assert [s[0].tolist() for s in shards] == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    assert [g[0].tolist() for g in shard_grads] == [[2, 0, 2, 0, 2], [0, 1, 1, 1, 0]]
    assert [g[0].tolist() for g in shard_grads] == [average[:5].tolist(), average[5:].tolist()]
    # One gather (of S elements per rank) in forward, one in backward, one reduce-scatter of N_pad; storage freed.
    assert calls == [("all_gather", 5), ("all_gather", 5), ("reduce_scatter", 10)]
    assert all(freed)


def test_self_check_four_ranks_rank_two_holds_the_bias_rank_three_only_padding(monkeypatch):
    theta, shard = padded_flat([example_unit().weight.detach(), example_unit().bias.detach()], 4)
    assert (theta.numel(), shard) == (12, 3)
    rows = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -2.0]]), torch.tensor([[0.5, 1.0]]),
            torch.tensor([[-1.0, 4.0]])]
    shards, shard_grads, _, _ = run_reference(
        monkeypatch, 4, lambda: torch.nn.Sequential(example_unit()), lambda r: rows[r], lambda y, r: y.sum())
    assert shards[2][0].tolist() == [7, 8, 9] and shards[3][0].tolist() == [0, 0, 0]
    assert shard_grads[3][0].tolist() == [0, 0, 0]


class Unit(torch.nn.Module):
    """A unit of three parameters whose total (7 * 5 + 5 + 5 * 2 = 50) is not a multiple of W = 3 or W = 4."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(7, 5)
        self.second = torch.nn.Linear(5, 2, bias=False)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


@pytest.mark.parametrize("world_size", [3, 4])
def test_reduce_scatter_of_the_flat_gradients_is_the_full_batch_gradient(monkeypatch, float64_by_default,
                                                                          world_size):
    torch.manual_seed(1)
    x, target = torch.randn(4 * world_size, 7), torch.randn(4 * world_size, 2)
    rows, targets = x.chunk(world_size), target.chunk(world_size)

    # One process, the full batch, the mean loss: the gradient the sharded training must reproduce.
    torch.manual_seed(0)
    model = torch.nn.Sequential(Unit(), torch.nn.Tanh())
    torch.nn.functional.mse_loss(model(x), target).backward()
    params = list(model[0].parameters())
    full_grad, shard = padded_flat([p.grad for p in params], world_size)
    assert (full_grad.numel(), shard) == (world_size * math.ceil(50 / world_size), math.ceil(50 / world_size))

    # The section's formula: each rank's flat gradient G_r of its own mean loss, through views of one flat theta.
    theta, _ = padded_flat([p.detach() for p in params], world_size)
    local = []
    for r in range(world_size):
        grad = flat_gradient(model[0], theta, rows[r],
                             lambda out, r=r: torch.nn.functional.mse_loss(torch.tanh(out), targets[r]))
        assert grad[50:].abs().max() == 0  # no view reads the padding
        local.append(grad)
    for r in range(world_size):
        by_formula = sum(g[r * shard : (r + 1) * shard] for g in local) / world_size
        torch.testing.assert_close(by_formula, full_grad[r * shard : (r + 1) * shard], rtol=1e-12, atol=1e-12)

    # The reference (float32 shards) on simulated ranks gives the same slices, and frees the gathered storage.
    torch.set_default_dtype(torch.float32)
    shards, shard_grads, calls, freed = run_reference(
        monkeypatch, world_size, lambda: copy.deepcopy(model).float(), lambda r: rows[r].float(),
        lambda out, r: torch.nn.functional.mse_loss(out, targets[r].float()))
    for r in range(world_size):
        torch.testing.assert_close(shards[r][0], theta[r * shard : (r + 1) * shard].float())
        torch.testing.assert_close(shard_grads[r][0], full_grad[r * shard : (r + 1) * shard].float(),
                                   rtol=1e-5, atol=1e-6)
    assert calls == [("all_gather", shard), ("all_gather", shard), ("reduce_scatter", world_size * shard)]
    assert all(freed)


SECTION = Path(__file__).resolve().parents[1] / "assignment/handout/sections/parallel/fsdp.typ"


def test_self_check_memory_and_traffic(monkeypatch):
    """12 units of 25e6 parameters, W = 8, AdamW, bf16 compute. Measured on the reference FSDP with 12 units of 64
    parameters (a multiple of W, as 25e6 is), then scaled: every count is linear in a unit's size. The bytes a
    collective sends are measured on the reference's ring collectives."""
    units, per_unit, world_size, small = 12, 25 * 10**6, 8, 64
    scale = per_unit // small
    ranks = Collectives(world_size, monkeypatch)

    def program(rank):
        torch.manual_seed(0)
        model = FSDP(torch.nn.Sequential(*(torch.nn.Linear(8, 8, bias=False) for _ in range(units))),
                     compute_dtype=torch.bfloat16)
        gathered = []
        for unit, child in zip(model.units, model.module):
            child.register_forward_pre_hook(
                lambda module, args, unit=unit: gathered.append(unit.gathered.untyped_storage().nbytes()))
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 8)).float().sum().backward()
        optimizer.step()
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        persistent = sum(t.untyped_storage().nbytes() for p in model.parameters() for t in (p, p.grad))
        return persistent + sum(t.untyped_storage().nbytes() for t in state), max(gathered)

    (persistent, gathered), *_ = ranks.run(program)
    psi = units * per_unit
    assert persistent * scale == bytes_per_parameter("zero3", world_size).total * psi == 6e8
    # Two units at once (at a boundary in backward), each its gathered parameters and its flat gradient.
    flat_gradient = max(n for (name, _), n in zip(ranks.calls, ranks.nbytes) if name == "reduce_scatter")
    assert 2 * (gathered + flat_gradient) * scale == 2e8
    measured = {call: bytes_sent_per_rank(monkeypatch, call[0], world_size,
                                          call[1] * (world_size if call[0] == "all_gather" else 1), torch.bfloat16)
                for call in set(ranks.calls)}
    sent = sum(measured[call] for call in ranks.calls)
    assert len(ranks.calls) == 3 * units and sent * scale == pytest.approx(1.575e9)
    assert sent * scale == pytest.approx(units * 3 * communication_volume("all_gather", 2 * per_unit, world_size))
    ddp = bytes_sent_per_rank(monkeypatch, "all_reduce", world_size, units * small, torch.bfloat16) * scale
    assert ddp == pytest.approx(1.05e9) == communication_volume("all_reduce", 2 * psi, world_size)
    text = " ".join(SECTION.read_text().split())
    for printed in ("16 dot 3 dot 10^8 slash 8 = 6 dot 10^8", "4 dot 2 dot 25 dot 10^6 = 2 dot 10^8",
                    "3 dot 7 slash 8 dot 2 dot 3 dot 10^8 = 1.575 dot 10^9", "$1.05 dot 10^9$"):
        assert printed in text, printed
