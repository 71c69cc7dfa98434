"""The data-parallel sections of the handout (DDP, bucketed DDP, ZeRO-1, ZeRO-2): every formula and printed number.

Checked as plain functions: the averaging of local mean gradients and its worked example, the step time of
all-reduces issued from hooks on a link that carries one at a time (the recurrence and its closed form, the figure's
and the self-check's numbers), the pinned bucket partition of the worked example against the reference's own
`_bucket_partition`, the ZeRO partition against the references' `_owners`, ZeRO-2's memory and traffic against
`reference.parallel.accounting`, and the ZeRO-1 self-check's optimizer-state bytes from torch's own Adam.

The references' classes themselves run on two ranks as threads of this process: their module's `dist` is replaced by
a small stand-in whose collectives meet at a barrier when a handle is waited on (every rank waits in issue order), and
which logs what each rank issues and when it waits. No process group is created and no process is spawned.
"""

import itertools
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import reference.parallel.collectives as collectives
import reference.parallel.ddp as ddp
import reference.parallel.ddp_bucketed as ddp_bucketed
import reference.parallel.zero1 as zero1
import reference.parallel.zero2 as zero2
from reference.parallel.accounting import bytes_per_parameter, communication_volume
from tests.thread_ranks import Messages, ThreadRanks, bytes_sent_per_rank

SECTIONS = Path(__file__).resolve().parents[1] / "assignment/handout/sections/parallel"


def assert_printed(name, *strings):
    """Each string is in the section's source, white space folded."""
    text = " ".join((SECTIONS / f"{name}.typ").read_text().split())
    for printed in strings:
        assert printed in text, printed

# --- DDP: why the average ----------------------------------------------------------------------------------------


def local_mean_gradient(w, examples):
    """d/dw of the mean of 1/2 (w x - t)^2 over the examples."""
    w = torch.tensor(float(w), dtype=torch.float64, requires_grad=True)
    x, t = (torch.tensor(column, dtype=torch.float64) for column in zip(*examples))
    (0.5 * (w * x - t) ** 2).mean().backward()
    return w.grad.item()


def test_average_of_local_mean_gradients_is_the_full_batch_gradient():
    """The worked example: -1 and 0.5 on the two ranks, average -0.25 = (-2 + 0 + 1 + 0) / 4, sum -0.5; and the same
    identity for random shards of equal size."""
    shards = [[(1, 3), (2, 2)], [(1, 0), (3, 3)]]
    local = [local_mean_gradient(1.0, shard) for shard in shards]
    assert local == [-1.0, 0.5]
    assert sum(local) / 2 == -0.25 == local_mean_gradient(1.0, shards[0] + shards[1]) == (-2 + 0 + 1 + 0) / 4
    assert sum(local) == -0.5
    assert_printed("ddp", "average $-0.25$ is the full batch's $(-2 + 0 + 1 + 0) \\/ 4$, and their sum $-0.5$")
    generator = torch.Generator().manual_seed(0)
    data = torch.randn(12, 2, generator=generator, dtype=torch.float64).tolist()
    for world_size in (2, 3, 4):
        shards = [data[r::world_size] for r in range(world_size)]
        average = sum(local_mean_gradient(0.3, shard) for shard in shards) / world_size
        assert average == pytest.approx(local_mean_gradient(0.3, data), rel=1e-12)


# --- DDP: what overlaps with what ---------------------------------------------------------------------------------


def finish_times(ready, comm):
    """f_i = max(ready_i, f_(i-1)) + t_c: one all-reduce at a time, in issue order."""
    finish, times = 0.0, []
    for t in ready:
        finish = max(t, finish) + comm
        times.append(finish)
    return times


def overlapped(layers, tb, tc):
    return finish_times([i * tb for i in range(1, layers + 1)], tc)[-1]


def blocking(layers, tb, tc):
    return finish_times([layers * tb] * layers, tc)[-1]


@pytest.mark.parametrize("layers", [1, 2, 4, 7])
@pytest.mark.parametrize("tb, tc", [(3, 2), (3, 4), (2, 2), (1, 5), (5, 0.5)])
def test_overlap_recurrence_has_the_closed_form(layers, tb, tc):
    """f_i = i t_b + t_c when t_c <= t_b, t_b + i t_c otherwise; T = max(L t_b, L t_c) + min(t_b, t_c)."""
    times = finish_times([i * tb for i in range(1, layers + 1)], tc)
    for i, f in enumerate(times, start=1):
        assert f == pytest.approx(i * tb + tc if tc <= tb else tb + i * tc)
    assert overlapped(layers, tb, tc) == pytest.approx(max(layers * tb, layers * tc) + min(tb, tc))
    assert blocking(layers, tb, tc) == pytest.approx(layers * tb + layers * tc)


def test_overlap_printed_numbers():
    """The section and its figure: L = 4, t_b = 3: 20 ms blocking and 14 overlapped at t_c = 2, 19 at t_c = 4; the
    self-check: L = 5, t_b = 4, t_c = 1: 25 and 21."""
    assert (blocking(4, 3, 2), overlapped(4, 3, 2), overlapped(4, 3, 4)) == (20, 14, 19)
    assert (blocking(5, 4, 1), overlapped(5, 4, 1)) == (25, 21)
    assert_printed("ddp", "gives 14 ms instead of 20 for $t_c = 2$ ms, and 19 for $t_c = 4$ ms",
                   "Blocking $5 dot 4 + 5 dot 1 = 25$ ms; overlapped $max(20, 5) + min(4, 1) = 21$ ms")


def test_hooks_fire_last_layer_first():
    """Post-accumulate hooks fire once per parameter, the last layer's before the first layer's."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4), torch.nn.ReLU(),
                                torch.nn.Linear(4, 2))
    names = {param: name for name, param in model.named_parameters()}
    fired = []
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: fired.append(names[p].split(".")[0]))
    model(torch.randn(5, 3)).square().mean().backward()
    assert len(fired) == 6
    assert [layer for layer, _ in itertools.groupby(fired)] == ["4", "2", "0"]


class TiedModel(torch.nn.Module):
    """The DDP self-check's model: an embedding tied to the output layer, 6 other trainable tensors, 2 frozen."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        self.frozen = torch.nn.Linear(4, 4).requires_grad_(False)
        self.out = torch.nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(self.frozen(self.body(self.embed(tokens))))


def test_ddp_self_check_counts(monkeypatch):
    """The reference DDP on the tied model, on two simulated ranks: 9 broadcasts at construction, 7 all-reduces per
    step. SGD at lr 0.1 on the undivided sum of 4 ranks' gradients takes the step lr 0.4 takes on their mean."""
    params = list(TiedModel().parameters())
    assert len(params) == 9 and sum(p.requires_grad for p in params) == 7

    def program(rank):
        wrapper = ddp.DDP(TiedModel())
        wrapper(torch.tensor([1, 2, 3])).square().mean().backward()
        wrapper.finish_gradient_synchronization()

    _, log = run_ranks(monkeypatch, [ddp], 2, program)
    for events in log:
        issued = [kind for event, kind, *_ in events if event == "issue"]
        assert (issued.count("broadcast"), issued.count("all_reduce")) == (9, 7)
    grads = torch.randn(4, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    steps = []
    for lr, grad in ((0.1, grads.sum(0)), (0.4, grads.mean(0))):
        weight = torch.zeros(5, dtype=torch.float64, requires_grad=True)
        weight.grad = grad
        torch.optim.SGD([weight], lr=lr).step()
        steps.append(weight.detach())
    torch.testing.assert_close(steps[0], steps[1], rtol=1e-15, atol=1e-15)
    assert_printed("ddp", "(1) 0.4: the sum is $W$ times the mean", "9 broadcasts", "7 all-reduces")


# --- Bucketed DDP ---------------------------------------------------------------------------------------------------


class BucketModel(torch.nn.Module):
    """The worked example: W1 (8 x 4), b1, W2 (8 x 8), b2 in float32; W3 (2 x 8), b3 in float64."""

    def __init__(self, last_dtype=torch.float64):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 8)
        self.fc3 = torch.nn.Linear(8, 2).to(last_dtype)

    def forward(self, x):
        return self.fc3(self.fc2(self.fc1(x)).to(self.fc3.weight.dtype))


def partition_names(model, limit_bytes):
    names = {param: name for name, param in model.named_parameters()}
    buckets = ddp_bucketed._bucket_partition(model, limit_bytes / ddp_bucketed.BYTES_PER_MB)
    return [[names[p] for p in bucket] for bucket in buckets], [
        sum(p.numel() * p.element_size() for p in bucket) for bucket in buckets]


def test_bucket_worked_example_and_self_check():
    """L = 288: {b3, W3} 144, {b2, W2} 288 (at the limit), {b1, W1} 160. L = 160: 144, {b2} 32, {W2} 256 alone,
    {b1, W1} 160. All float32 with L = 2^20: one bucket of 520 bytes."""
    model = BucketModel()
    sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    assert sizes == {"fc1.weight": 128, "fc1.bias": 32, "fc2.weight": 256, "fc2.bias": 32, "fc3.weight": 128,
                     "fc3.bias": 16}
    assert partition_names(model, 288) == (
        [["fc3.bias", "fc3.weight"], ["fc2.bias", "fc2.weight"], ["fc1.bias", "fc1.weight"]], [144, 288, 160])
    assert partition_names(model, 160) == (
        [["fc3.bias", "fc3.weight"], ["fc2.bias"], ["fc2.weight"], ["fc1.bias", "fc1.weight"]], [144, 32, 256, 160])
    buckets, sizes = partition_names(BucketModel(last_dtype=torch.float32), 2**20)
    assert len(buckets) == 1 and sizes == [520]
    assert_printed("ddp_bucketed", "With $L = 288$ bytes: $b_3 + W_3 = 144$", "${b_3, W_3}$ (144 bytes), ${b_2}$ (32",
                   "${W_2}$ (256, larger than $L$, alone)", "${b_1, W_1}$ ($32 + 128 = 160$",
                   "$8 + 64 + 32 + 256 + 32 + 128 = 520$")


# --- ZeRO ----------------------------------------------------------------------------------------------------------


def test_zero2_memory_from_the_accounting():
    """2 Psi + (2 + K) Psi / N with K = 12 is 2 + 14 / N per parameter, as parallel.accounting computes, against
    4 + 12 / N for ZeRO-1 and 16 for DDP."""
    for n in (1, 2, 3, 8, 64):
        assert bytes_per_parameter("zero2", n).total == pytest.approx(2 + 14 / n)
        assert bytes_per_parameter("zero1", n).total == pytest.approx(4 + 12 / n)
        assert bytes_per_parameter("ddp", n).total == 16


def test_zero2_worked_example_and_self_check():
    """Sizes (6, 3, 3, 4, 2) on 2 ranks: owners (0, 1, 1, 0, 1), running totals as printed; 176 and 148 bytes, mean
    162, DDP 288, ZeRO-1 rank 0 192. Psi = 2e9 on 8 ranks: 7.5e9 bytes, DDP 32e9. Rank 1's gradients None: p0, p3;
    it broadcasts p1, p2, p4, 8 elements."""
    sizes, n = [6, 3, 3, 4, 2], 2
    owners = zero2._owners(sizes, n)
    assert owners == [0, 1, 1, 0, 1] == zero1._owners(sizes, n)
    totals, held = [], [0, 0]
    for size, owner in zip(sizes, owners):
        held[owner] += size
        totals.append(tuple(held))
    assert totals == [(6, 0), (6, 3), (6, 6), (10, 6), (10, 8)]
    psi = sum(sizes)
    # Per rank from the accounting's bytes of each kind (unsharded, N = 1): what is replicated counts Psi times,
    # what is sharded the elements the rank owns.
    kind = bytes_per_parameter("ddp", 1)
    per_rank = [kind.parameters * psi + (kind.gradients + kind.optimizer_state) * held[r] for r in range(n)]
    assert per_rank == [176, 148]
    assert sum(per_rank) / n == 162 == pytest.approx(bytes_per_parameter("zero2", n).total * psi)
    assert bytes_per_parameter("ddp", n).total * psi == 288
    assert (kind.parameters + kind.gradients) * psi + kind.optimizer_state * held[0] == 192
    assert_printed("zero2", "the running totals", "$(10, 8)$. Owners $(0, 1, 1, 0, 1)$",
                   "$2 dot 18 + 14 dot 10 = 176$", "$2 dot 18 + 14 dot 8 = 148$", "$162 = (2 + 14 slash 2) dot 18$",
                   "$16 dot 18 = 288$", "$4 dot 18 + 12 dot 10 = 192$",
                   "$(2 + 14 slash 8) dot 2 dot 10^9 = 7.5 dot 10^9$", "$32 dot 10^9$", "($p_0$, $p_3$",
                   "$p_1$, $p_2$ and $p_4$, 8 elements")
    assert bytes_per_parameter("zero2", 8).total * 2e9 == pytest.approx(7.5e9)
    assert bytes_per_parameter("ddp", 8).total * 2e9 == pytest.approx(32e9)
    assert [j for j, o in enumerate(owners) if o != 1] == [0, 3]
    assert [j for j, o in enumerate(owners) if o == 1] == [1, 2, 4]
    assert sum(sizes[j] for j, o in enumerate(owners) if o == 1) == 8


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_zero2_traffic_equals_the_all_reduce(monkeypatch, world_size):
    """A reduce and a broadcast per parameter send 2 (N - 1) b in all: N times the all-reduce's per-rank volume. Both
    measured on the reference's collectives, run on simulated ranks."""
    for b in (world_size, 8 * world_size):
        ranks = Messages(world_size, monkeypatch)

        def program(rank):
            tensor = torch.ones(b)
            collectives.reduce(tensor, dst=0)
            collectives.broadcast(tensor, src=0)

        ranks.run(program)
        reduce_and_broadcast = sum(ranks.elements_sent()) * 4
        assert reduce_and_broadcast == 2 * (world_size - 1) * 4 * b
        assert reduce_and_broadcast == world_size * bytes_sent_per_rank(monkeypatch, "all_reduce", world_size, b)
        assert reduce_and_broadcast == pytest.approx(world_size * communication_volume("all_reduce", 4 * b, world_size))


def test_zero1_self_check():
    """(5, 5, 2, 2, 2) on 3 ranks: owners (0, 1, 2, 2, 2); Adam's state 44, 44 and 60 bytes, 148 unsharded."""
    sizes = [5, 5, 2, 2, 2]
    owners = zero1._owners(sizes, 3)
    assert owners == [0, 1, 2, 2, 2]
    held = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(3)]
    assert held == [5, 5, 6] and max(held) - 16 / 3 <= max(sizes)

    def state_bytes(params):
        optimizer = torch.optim.Adam(params)
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
                   if torch.is_tensor(t))

    params = [torch.zeros(s, dtype=torch.float32, requires_grad=True) for s in sizes]
    per_rank = [state_bytes([p for p, o in zip(params, owners) if o == r]) for r in range(3)]
    assert per_rank == [44, 44, 60]
    assert sum(per_rank) == 148 == state_bytes(params)
    assert_printed("zero1", "(1) $(0, 1, 2, 2, 2)$", "$44$, $44$ and $6 dot 8 + 3 dot 4 = 60$ bytes, $148$ in all",
                   "$16 dot 8 + 5 dot 4$")


# --- The references on two ranks, as threads -------------------------------------------------------------------------


class Work:
    def __init__(self, run):
        self._run, self._done = run, False

    def wait(self):
        if not self._done:
            self._run()
            self._done = True
        return True


class ThreadDist(ThreadRanks):
    """What the references use of torch.distributed, for ranks that are threads; a collective meets the other ranks
    when it is waited on (at once when not async), so every rank must wait in the same order, as they do. Unlike
    `tests.thread_ranks.Collectives` its collectives are asynchronous (a handle whose wait() meets the other ranks) and
    include broadcast and reduce; `log[r]` lists what rank r issued and when it waited."""

    ReduceOp = dist.ReduceOp
    group = types.SimpleNamespace(WORLD=None)

    def __init__(self, world_size):
        super().__init__(world_size)
        self.slots = {}
        self.log = [[] for _ in range(world_size)]

    def _meet(self, tensor, combine):
        me, index = self.local.rank, getattr(self.local, "count", 0)
        self.local.count = index + 1
        with torch.no_grad():
            self.slots[index, me] = tensor.detach().clone()
            self.barrier.wait()
            result = combine([self.slots[index, r] for r in range(self.world_size)])
            self.barrier.wait()
            if result is not None:
                tensor.copy_(result)

    def _issue(self, kind, tensor, combine, async_op):
        self.log[self.local.rank].append(("issue", kind, tensor.numel() * tensor.element_size()))

        def run():
            self.log[self.local.rank].append(("wait", kind))
            self._meet(tensor, combine)

        work = Work(run)
        if async_op:
            return work
        work.wait()
        return None

    def broadcast(self, tensor, src, group=None, async_op=False):
        return self._issue("broadcast", tensor, lambda values: values[src], async_op)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return self._issue("all_reduce", tensor, lambda values: sum(values), async_op)

    def reduce(self, tensor, dst, op=dist.ReduceOp.SUM, group=None, async_op=False):
        me = self.local.rank
        return self._issue("reduce", tensor, lambda values: sum(values) if me == dst else None, async_op)


def run_ranks(monkeypatch, modules, world_size, program):
    fake = ThreadDist(world_size)
    for module in modules:
        monkeypatch.setattr(module, "dist", fake)
    return fake.run(program), fake.log


def test_reference_ddp_on_the_worked_example(monkeypatch):
    """The reference DDP on the averaging example: rank 1 starts from another weight and gets rank 0's; both end with
    the full-batch gradient -0.25; every all-reduce is issued before the first wait."""
    shards = [[(1, 3), (2, 2)], [(1, 0), (3, 3)]]

    def program(rank):
        model = torch.nn.Linear(1, 1, bias=False, dtype=torch.float64)
        with torch.no_grad():
            model.weight.fill_(1.0 if rank == 0 else 5.0)
        wrapper = ddp.DDP(model)
        x, t = (torch.tensor(column, dtype=torch.float64)[:, None] for column in zip(*shards[rank]))
        (0.5 * (wrapper(x) - t) ** 2).mean().backward()
        wrapper.finish_gradient_synchronization()
        return model.weight.item(), model.weight.grad.item()

    results, log = run_ranks(monkeypatch, [ddp], 2, program)
    assert results == [(1.0, -0.25), (1.0, -0.25)]
    for events in log:
        steps = [e for e in events if e[1] == "all_reduce"]
        assert [e[0] for e in steps] == ["issue", "wait"]


def test_reference_bucketed_ddp_issues_the_worked_example_buckets(monkeypatch):
    """With L = 288 bytes the reference issues three all-reduces during backward, of 144, 288 and 160 bytes in that
    order, before waiting on any."""

    def program(rank):
        torch.manual_seed(rank)
        model = BucketModel()
        wrapper = ddp_bucketed.BucketedDDP(model, 288 / ddp_bucketed.BYTES_PER_MB)
        wrapper(torch.randn(3, 4)).sum().backward()
        wrapper.finish_gradient_synchronization()
        return [p.grad.clone() for p in model.parameters()]

    results, log = run_ranks(monkeypatch, [ddp_bucketed], 2, program)
    for events in log:
        reduces = [e for e in events if e[1] == "all_reduce"]
        assert reduces == [("issue", "all_reduce", 144), ("issue", "all_reduce", 288), ("issue", "all_reduce", 160)] \
            + [("wait", "all_reduce")] * 3
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_reference_zero2_on_the_worked_example(monkeypatch):
    """Sizes (6, 3, 3, 4, 2) on 2 ranks: after the reduces rank 1 holds gradients for p1, p2, p4 only, each the
    average of the two ranks' local gradients (1.5 (j + 1)); one reduce per parameter, and after step() both ranks
    hold the same parameters."""
    sizes = [6, 3, 3, 4, 2]

    def program(rank):
        torch.manual_seed(0)
        params = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in sizes])
        wrapper = zero2.ZeRO2(params, torch.optim.SGD, lr=0.5)
        sum(((rank + 1) * (j + 1) * p).sum() for j, p in enumerate(params)).backward()
        wrapper.finish_gradient_synchronization()
        grads = [None if p.grad is None else p.grad.clone() for p in params]
        wrapper.step()
        return grads, [p.detach().clone() for p in params]

    results, log = run_ranks(monkeypatch, [zero2], 2, program)
    (grads0, params0), (grads1, params1) = results
    assert [g is None for g in grads1] == [True, False, False, True, False]
    assert [g is None for g in grads0] == [False, True, True, False, True]
    for j, g in enumerate([grads0[0], grads1[1], grads1[2], grads0[3], grads1[4]]):
        assert torch.equal(g, torch.full((sizes[j],), 1.5 * (j + 1), dtype=torch.float64))
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))
    for events in log:
        issued = [e[2] for e in events if e[1] == "reduce" and e[0] == "issue"]
        assert sorted(issued) == sorted(8 * s for s in sizes)
        assert [e[:2] for e in events].count(("issue", "broadcast")) == 2 * len(sizes)  # construction, step()
