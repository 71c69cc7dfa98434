"""Memory probes for grader programs (in rank processes and in the sandbox worker): bytes of tensor storage held.

What is measured is the same on both devices: the bytes of every tensor storage that is alive, wherever the
reference to it is kept (a module attribute, a list, a closure, a tensor saved by autograd for backward, a
communication buffer). A program opens a probe before it builds anything, marks the start of the region it grades
with `start()`, calls `probe(where)` at points of interest, and reads the peak above the start.

- CUDA: the caching allocator's own counters, less what was allocated when the probe was opened. `start()` reads
  `torch.cuda.memory_allocated` as the baseline and resets the peak; the peak is `torch.cuda.max_memory_allocated`,
  so it covers every moment, not only the probe points. The probe points only name where the highest one of them
  was. cuBLAS takes its workspaces (tens of MiB, one per thread: autograd runs backward in a thread of its own) from
  the same allocator on first use, so opening the probe runs a linear layer forward and backward first.
- CPU: no allocator counter exists, so a `TorchDispatchMode` sees the result of every operator run while the probe is
  open and keeps a weak reference to each storage that is new (not the storage of one of the operator's inputs: views
  and in-place results add nothing). Live bytes are the sum of `nbytes()` of those still alive, read when probed, so a
  storage resized to zero (the usual way to free gathered parameters that autograd still refers to) counts zero and
  one regrown counts again. The peak is over the probe points. Storages created before the probe was opened, or
  outside torch's operators (from numpy, say), are not seen: open the probe before building the model.
"""

from __future__ import annotations

import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CUDA_BLOCK_BYTES = 512  # the caching allocator hands out blocks of this many bytes at least
# What a region leaves alive is read this many times, this far apart, and the least reading kept (settled_probe).
SETTLE_READINGS, SETTLE_INTERVAL_S = 20, 0.01


def allocated_bytes(tensor_bytes: int, device: str) -> int:
    """What a tensor of these bytes adds to what a probe on `device` measures: CUDA rounds up to whole blocks."""
    if device.startswith("cuda"):
        return -(-tensor_bytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return tensor_bytes


def _storages(values) -> list[torch.UntypedStorage]:
    found = []
    for value in tree_flatten(values)[0]:
        if isinstance(value, torch.Tensor) and value.layout == torch.strided and value.device.type != "meta":
            found.append(value.untyped_storage())
    return found


class _StorageTracker(TorchDispatchMode):
    """Weak references to every storage first produced by an operator while the mode is active."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, weakref.ref] = {}  # keyed by the storage's C++ address, unique while it is alive

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        inputs = {s._cdata for s in _storages((args, kwargs))}
        for storage in _storages(result):
            key = storage._cdata
            if key in inputs or (key in self.live and self.live[key]() is not None):
                continue
            self.live[key] = weakref.ref(storage, self._forget(key))
        return result

    def _forget(self, key: int):
        def forget(reference: weakref.ref) -> None:
            if self.live.get(key) is reference:
                del self.live[key]

        return forget

    def live_bytes(self) -> int:
        total = 0
        for reference in list(self.live.values()):
            storage = reference()
            if storage is not None:
                total += storage.nbytes()
        return total


def _allocate_library_workspaces(device: torch.device) -> None:
    """A linear layer's forward and backward in each dtype the graded programs compute in, with and without bias (two
    cuBLAS paths), so that cuBLAS has taken its workspaces in this thread and in autograd's."""
    for dtype in (torch.float32, torch.bfloat16):
        x, weight, bias = (torch.ones(shape, device=device, dtype=dtype, requires_grad=True)
                           for shape in ((8, 8), (8, 8), (8,)))
        (torch.nn.functional.linear(x, weight, bias) + torch.nn.functional.linear(x, weight)).sum().backward()


class MemoryProbe:
    """Bytes of tensor storage held on `device`, and their peak above a start point (see the module docstring).

        with MemoryProbe(device) as memory:
            model = build()               # seen: built inside the probe
            memory.start()
            out = model(x); memory.probe("after forward")
            peak, where = memory.peak_above_start()
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.tracker = None if self.on_cuda else _StorageTracker()
        self.opened_at = 0  # CUDA: bytes allocated when the probe was opened, which it does not count
        self.baseline = 0
        self.peak = 0
        self.peak_where = "start"

    def __enter__(self) -> "MemoryProbe":
        if self.tracker is not None:
            self.tracker.__enter__()
        else:
            _allocate_library_workspaces(self.device)
            torch.cuda.synchronize(self.device)
            self.opened_at = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(*exc)

    def live_bytes(self) -> int:
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device) - self.opened_at
        return self.tracker.live_bytes()

    def start(self) -> None:
        """Begin a graded region: the bytes held now are the baseline, and the peak starts from them."""
        self.baseline = self.live_bytes()
        self.peak, self.peak_where = self.baseline, "start"
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def probe(self, where: str) -> int:
        """Record the bytes held now (named `where` if they are the highest so far); returns them above the start."""
        return self._record(self.live_bytes(), where)

    def settled_probe(self, where: str) -> int:
        """probe(where) for the bytes a finished region leaves alive: the least of SETTLE_READINGS readings.

        A collective's tensors stay referenced by its work object until the backend lets go of it, and gloo's worker
        thread does so a moment after wait() has returned (when it next takes its queue's lock). On a busy machine
        that moment can come after a single reading, which then counts a freed gradient as kept (seen once in CI
        on the reference's ZeRO-2). A tensor the program keeps is in every reading."""
        least = self.live_bytes()
        for _ in range(SETTLE_READINGS - 1):
            time.sleep(SETTLE_INTERVAL_S)
            least = min(least, self.live_bytes())
        return self._record(least, where)

    def _record(self, held: int, where: str) -> int:
        if held > self.peak:
            self.peak, self.peak_where = held, where
        return held - self.baseline

    def peak_above_start(self) -> tuple[int, str]:
        """(peak bytes held above the baseline since start(), where the highest probe point was)."""
        peak = self.peak
        if self.on_cuda:
            peak = max(peak, torch.cuda.max_memory_allocated(self.device) - self.opened_at)
        return peak - self.baseline, self.peak_where


class ProbePoint(torch.autograd.Function):
    """Identity that probes memory when the forward passes it and again when the backward does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, memory: MemoryProbe, where: str) -> torch.Tensor:
        ctx.memory, ctx.where = memory, where
        memory.probe(f"forward, {where}")
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.memory.probe(f"backward, {ctx.where}")
        return grad, None, None


def probe_point(x: torch.Tensor, memory: MemoryProbe | None, where: str) -> torch.Tensor:
    """`x` unchanged; with a probe, memory is probed here in forward and in backward."""
    return x if memory is None else ProbePoint.apply(x, memory, where)
