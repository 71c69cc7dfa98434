"""A simulated network link: a process group whose all-reduce takes LATENCY_S + bytes * SECONDS_PER_BYTE of wall time.

The reduction itself runs on an inner gloo group, on the CPU, and takes a millisecond or so; the link then holds the
result back until its modelled finish. Like a real link it carries one collective at a time, in the order they were
issued: a collective issued while the link is busy starts when the one before it finishes,

    finish = max(issued, previous finish) + LATENCY_S + bytes * SECONDS_PER_BYTE.

The wait happens on a thread of the link, so an all-reduce issued with async_op=True overlaps whatever the rank does
next (a backward that goes on), and one that is waited on at once blocks for its whole cost. The times are thus the
same on any machine: parallel.analysis measures bucketed DDP's step time over this link. Students may import it to
run the same measurement (`simulated_link_group()` after `dist.init_process_group`).

It carries all_reduce and broadcast (a broadcast costs nothing: DDP broadcasts once, at construction, outside the
timed steps). Any other collective raises: NotImplementedError saying so, or for all_gather_into_tensor and
reduce_scatter_tensor, torch's RuntimeError about a missing CPU backend.
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

BACKEND = "simulated_link"
LATENCY_S = 0.010
SECONDS_PER_BYTE = 0.060 / 2**20  # 60 ms per MiB: about 17 MiB/s


def cost_s(num_bytes: int) -> float:
    """Seconds the link takes to all-reduce `num_bytes`, once it is free."""
    return LATENCY_S + num_bytes * SECONDS_PER_BYTE


class SimulatedLink(dist.ProcessGroup):
    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self.inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.in_flight: queue.Queue = queue.Queue()
        threading.Thread(target=self._carry, name="simulated-link", daemon=True).start()

    def _carry(self) -> None:
        """Completes the issued all-reduces one after another, each at its modelled finish."""
        free_at = 0.0
        while (item := self.in_flight.get()) is not None:
            issued, work, seconds, future, tensors = item
            finish = max(issued, free_at) + seconds
            try:
                work.wait()
            except RuntimeError as error:  # a peer that died (DistBackendError): hand it to whoever waits
                future.set_exception(error)
                continue
            time.sleep(max(0.0, finish - time.perf_counter()))
            free_at = finish
            future.set_result(tensors)

    def allreduce(self, tensors: list[torch.Tensor], opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        issued = time.perf_counter()
        num_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
        future = Future()
        self.in_flight.put((issued, self.inner.allreduce(tensors, opts), cost_s(num_bytes), future, tensors))
        return _create_work_from_future(future)

    def broadcast(self, tensors: list[torch.Tensor], opts=None):
        return self.inner.broadcast(tensors, opts if opts is not None else dist.BroadcastOptions())

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError("the simulated link carries all_reduce and broadcast only: bucketed DDP issues "
                                  "one all_reduce per bucket in a step (parallel.ddp_bucketed's contract) and "
                                  "broadcasts once, when it is built")

    # torch.distributed's list-based collectives call these methods of the group; without them they would fail with a
    # message about a missing CPU backend, as the tensor forms (all_gather_into_tensor, reduce_scatter_tensor) do.
    allgather = reduce_scatter = reduce = barrier = gather = scatter = alltoall = alltoall_base = send = recv = _refuse

    def close(self) -> None:
        """Ends the link's thread once the collectives issued so far are done."""
        self.in_flight.put(None)

    def getBackendName(self) -> str:
        return BACKEND


_registered = False


def simulated_link_group() -> SimulatedLink:
    """A group of every rank over a simulated link. Call on every rank, after dist.init_process_group."""
    global _registered
    if not _registered:
        dist.Backend.register_backend(BACKEND, SimulatedLink, devices=["cpu"])
        _registered = True
    return dist.new_group(backend=BACKEND)
