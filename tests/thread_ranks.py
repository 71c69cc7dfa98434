"""The ranks of a torch.distributed job, simulated as threads of this process, for the handout's tests.

The parallel references call torch.distributed (or, for `reference.parallel.collectives`, one message primitive of
their own). A real job would need a process group and spawned processes: seconds to start per test, and a rank's
exception seen only as another rank's timeout. The handout's tests need neither real concurrency nor a backend, only
every rank running the same program at once and the order and contents of what the ranks exchange. Threads give that
in one address space: a collective becomes a barrier and a copy, a message a queue, and every call can be logged in
one place. `ThreadRanks` is the part every such stand-in shares (which rank a thread is, running a program on every
rank, stopping them all when one fails); its subclasses here stand in for torch.distributed's in-place collectives
(`Collectives`) and for the collectives module's `_exchange` (`Messages`). Stand-ins for other calls (all_to_all_single,
send and recv, async collectives) subclass `ThreadRanks` in the test that needs them.
"""

import queue
import threading

import torch
import torch.distributed as dist

import reference.parallel.collectives as collectives

TIMEOUT_S = 30


class ThreadRanks:
    """W ranks as threads of one process: `run(program)` calls program(rank) on every rank at once."""

    def __init__(self, world_size):
        self.world_size, self.local = world_size, threading.local()
        self.barrier = threading.Barrier(world_size, timeout=TIMEOUT_S)

    def get_rank(self, group=None):
        return self.local.rank

    def get_world_size(self, group=None):
        return self.world_size

    def get_global_rank(self, group, rank):
        return rank

    def run(self, program):
        """program(rank) on every rank at once; the ranks' results, in rank order. The first rank's exception is
        raised once every thread has stopped (the barrier is broken so that no rank waits for a rank that failed)."""
        results, errors = [None] * self.world_size, []

        def body(rank):
            self.local.rank = rank
            try:
                results[rank] = program(rank)
            except Exception as error:  # noqa: BLE001 - re-raised below, after every thread has stopped
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(rank,)) for rank in range(self.world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


class Collectives(ThreadRanks):
    """torch.distributed's all_reduce, all_gather_into_tensor and reduce_scatter_tensor (sums), done in memory, in
    order; `calls` logs each one rank 0 issues as (name, elements of its input), `nbytes` the bytes of that input."""

    def __init__(self, world_size, monkeypatch):
        super().__init__(world_size)
        self.posted, self.calls, self.nbytes = [None] * world_size, [], []
        for name in ("get_rank", "get_world_size", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
            monkeypatch.setattr(dist, name, getattr(self, name))

    def _exchange(self, name, tensor):
        """Every rank posts its tensor; every rank gets all of them, in rank order."""
        if self.local.rank == 0:
            self.calls.append((name, tensor.numel()))
            self.nbytes.append(tensor.numel() * tensor.element_size())
        self.posted[self.local.rank] = tensor.detach().clone()
        self.barrier.wait()
        posted = list(self.posted)
        self.barrier.wait()
        return posted

    def all_reduce(self, tensor, op=None, group=None):
        tensor.copy_(sum(self._exchange("all_reduce", tensor)))

    def all_gather_into_tensor(self, out, tensor, group=None):
        out.copy_(torch.cat(self._exchange("all_gather", tensor)))

    def reduce_scatter_tensor(self, out, tensor, op=None, group=None):
        out.copy_(sum(self._exchange("reduce_scatter", tensor)).chunk(self.world_size)[self.local.rank])


class Messages(ThreadRanks):
    """`reference.parallel.collectives` with its one message primitive, `_exchange`, replaced by a queue per pair of
    ranks; `sent[r]` lists what rank r sent, in order, as (destination, values)."""

    def __init__(self, world_size, monkeypatch):
        super().__init__(world_size)
        self.links = {(a, b): queue.Queue() for a in range(world_size) for b in range(world_size)}
        self.sent = [[] for _ in range(world_size)]
        monkeypatch.setattr(collectives, "_exchange", self.exchange)
        monkeypatch.setattr(collectives, "_rank_and_size", lambda group: (self.local.rank, world_size))

    def exchange(self, group, send=None, dst=0, recv=None, src=0):
        me = self.local.rank
        if send is not None and send.numel() > 0:
            self.sent[me].append((dst, send.flatten().tolist()))
            self.links[me, dst].put(send.clone())
        if recv is not None and recv.numel() > 0:
            recv.copy_(self.links[src, me].get(timeout=TIMEOUT_S))

    def elements_sent(self):
        """How many elements each rank sent, in rank order."""
        return [sum(len(values) for _, values in sent) for sent in self.sent]


def bytes_sent_per_rank(monkeypatch, collective, world_size, elements, dtype=torch.float32):
    """The bytes the reference's `collective` sends per rank, averaged over the ranks (what
    `reference.parallel.accounting.communication_volume` counts), measured by running it on `world_size` threads.
    `elements` is the size of the all-reduced tensor, of an all-gather's output or of a reduce-scatter's input."""
    ranks = Messages(world_size, monkeypatch)
    size = torch.empty(elements).tensor_split(world_size)

    def program(rank):
        if collective == "all_reduce":
            collectives.all_reduce(torch.ones(elements, dtype=dtype))
        elif collective == "all_gather":
            pieces = [torch.empty(elements // world_size, dtype=dtype) for _ in range(world_size)]
            collectives.all_gather(pieces, torch.ones(elements // world_size, dtype=dtype))
        elif collective == "reduce_scatter":
            collectives.reduce_scatter(torch.empty(size[rank].numel(), dtype=dtype), torch.ones(elements, dtype=dtype))
        else:
            raise ValueError(collective)

    ranks.run(program)
    return sum(ranks.elements_sent()) * torch.empty(0, dtype=dtype).element_size() / world_size
