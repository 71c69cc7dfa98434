"""Evidence that a Triton problem's kernels did its work: they read every input and wrote every output.

The operator allowlist (grader.sandbox.allowed_ops) keeps torch from computing; this recorder shows the other half,
from what the launches touched while a call ran:

* under Triton's interpreter (CPU), the address of every element each load read and each store wrote, from the
  interpreter's own load and store operations: every element of every input must have been loaded, and every
  element of every output stored, by some launch;
* on a GPU, where loads and stores happen out of sight, the byte range of every tensor argument of every launch:
  every input and every output must have been an argument of some launch.

torch's copies (`.contiguous()`, `.to()`, `clone`, `copy_`) move values without computing them, so they carry the
evidence along: an input copied into a buffer that a kernel loaded counts as read, and an output cast from a buffer a
kernel stored counts as written. Like every check in the worker, this names an honest shortcut (values computed
from memory read around torch, say) and cannot stop code that defeats the recorder itself.

It also counts the lanes of every load, repeated reads and masked-off lanes included: a measure of the work the
kernels did, which problems that must skip blocks (a sliding window) compare across sequence lengths.

The recorder also keeps the widest block a launch held (a tensor of two or more dimensions inside a kernel): from the
interpreter's tensors on CPU, from each compiled kernel's Triton IR on a GPU. Tiled problems bound it.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import numpy as np
import torch

from grader.sandbox import allowed_ops
from grader.session import backend

# torch operators that copy values from a source tensor into a new (or given) tensor, element for element.
COPY_OPS = ("aten._to_copy", "aten.clone", "aten.contiguous", "aten.copy_", "aten.lift_fresh_copy")
# `tensor<128x64xf16>` and the like in Triton IR: the shape of a block of two or more dimensions.
_IR_BLOCK = re.compile(r"tensor<(\d+(?:x\d+)+)x[a-z!]")


def element_addresses(tensor: torch.Tensor) -> np.ndarray:
    """The start address of every element of a CPU tensor, in its logical order (repeated where strides are 0)."""
    offsets = np.zeros((), dtype=np.int64)
    for size, stride in zip(tensor.shape, tensor.stride()):
        offsets = np.add.outer(offsets, np.arange(size, dtype=np.int64) * stride)
    return (tensor.data_ptr() + offsets.reshape(-1) * tensor.element_size()).astype(np.uint64)


def byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the bytes a tensor's elements occupy."""
    start = end = tensor.data_ptr()
    for size, stride in zip(tensor.shape, tensor.stride()):
        span = (size - 1) * stride * tensor.element_size()
        start, end = (start + span, end) if span < 0 else (start, end + span)
    return start, end + tensor.element_size()


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class TrafficRecorder:
    """What Triton launches touched between start() and stop(); see the module's docstring."""

    def __init__(self) -> None:
        self.active = False
        self.by_address = False
        self.clear()

    def start(self, by_address: bool) -> None:
        self.clear()
        self.active = True
        self.by_address = by_address

    @contextlib.contextmanager
    def recording(self):
        """Record inside the block: by address under Triton's interpreter, by launch argument on a GPU."""
        self.start(by_address=backend.interpreting())
        try:
            yield self
        finally:
            self.stop()

    def clear(self) -> None:
        self.argument_ranges: list[tuple[int, int]] = []
        self.loaded = _Addresses()
        self.loaded_lanes = 0  # every load's lanes, repeats and masked lanes included: the work, not the footprint
        self.stored = _Addresses()
        # (destination, source), in order: address arrays of equal length, or byte ranges on a GPU.
        self.copies: list[tuple[Any, Any]] = []
        self.widest_block: tuple[str, tuple[int, ...]] | None = None

    def stop(self) -> None:
        self.active = False

    # --- what the hooks report ------------------------------------------------------------------------------------

    def note_arguments(self, ranges: list[tuple[int, int]]) -> None:
        if self.active:
            self.argument_ranges += ranges

    def note_access(self, op: str, addresses: np.ndarray, lanes: int) -> None:
        """op: "load", "store", or "atomic" (which reads and writes); lanes: the access's block size, masked lanes
        included, so that a loop over blocks it then masks off still counts as work."""
        if self.active and self.by_address:
            if op != "store":
                self.loaded.add(addresses)
                self.loaded_lanes += lanes
            if op != "load":
                self.stored.add(addresses)

    def note_block(self, kernel: str, shape: tuple[int, ...]) -> None:
        """Keep the block with the longest dimension (the larger, of two as long)."""
        if not self.active or len(shape) < 2:
            return
        if self.widest_block is None or _width(shape) > _width(self.widest_block[1]):
            self.widest_block = (kernel, tuple(shape))

    def note_ir(self, kernel: str, ir: str) -> None:
        for found in _IR_BLOCK.finditer(ir):
            self.note_block(kernel, tuple(int(n) for n in found.group(1).split("x")))

    def note_op(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        """Called for every operator the call runs: copies carry the evidence (see the module's docstring)."""
        if not self.active or name not in COPY_OPS:
            return
        source = args[1] if name == "aten.copy_" else args[0]
        destination = args[0] if name == "aten.copy_" else out
        if not (isinstance(source, torch.Tensor) and isinstance(destination, torch.Tensor)) or destination.numel() == 0:
            return
        if _same_elements(source, destination) or allowed_ops.called_by_triton():
            return  # the interpreter's own copies of its arguments to and from the host move nothing on a CPU
        if self.by_address:
            if source.device.type == "cpu" and destination.device.type == "cpu":
                self.copies.append((element_addresses(destination),
                                    element_addresses(source.expand(destination.shape))))
        else:
            self.copies.append((byte_range(destination), byte_range(source)))

    # --- the evidence ---------------------------------------------------------------------------------------------

    def unread(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Which of `tensors` no launch read, whole or in part: 'name: n of N elements' (or 'name' on a GPU)."""
        if self.by_address:
            read = self.loaded.unique()
            for destination, source in reversed(self.copies):  # a later copy first: chains of copies carry back
                read = np.union1d(read, source[_within(destination, read)])
            return _missing(tensors, read)
        read_ranges = list(self.argument_ranges)
        for destination, source in reversed(self.copies):
            if any(_overlaps(destination, r) for r in read_ranges):
                read_ranges.append(source)
        return [name for name, t in _nonempty(tensors) if not any(_overlaps(byte_range(t), r) for r in read_ranges)]

    def unwritten(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Which of `tensors` no launch wrote, whole or in part (copies of what a launch wrote count as written)."""
        if self.by_address:
            written = self.stored.unique()
            for destination, source in self.copies:
                written = np.union1d(written, destination[_within(source, written)])
            return _missing(tensors, written)
        written_ranges = list(self.argument_ranges)
        for destination, source in self.copies:
            if any(_overlaps(source, r) for r in written_ranges):
                written_ranges.append(destination)
        return [name for name, t in _nonempty(tensors) if not any(_overlaps(byte_range(t), r) for r in written_ranges)]


class _Addresses:
    """Element addresses, kept as the arrays they came in until there are many, then merged into one sorted array
    without repeats: a kernel that re-reads its inputs (attention reads K and V once per query block) would otherwise
    keep every read."""

    COMPACT_EVERY = 1 << 22

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.size = 0

    def add(self, addresses: np.ndarray) -> None:
        self.arrays.append(addresses.copy())
        self.size += addresses.size
        if self.size > self.COMPACT_EVERY:
            self.arrays = [self.unique()]
            self.size = self.arrays[0].size

    def unique(self) -> np.ndarray:
        return np.unique(np.concatenate(self.arrays)) if self.arrays else np.zeros(0, dtype=np.uint64)


def _within(addresses: np.ndarray, sorted_unique: np.ndarray) -> np.ndarray:
    """Which of `addresses` are in `sorted_unique` (a sorted array without repeats)."""
    if sorted_unique.size == 0:
        return np.zeros(addresses.shape, dtype=bool)
    at = np.minimum(np.searchsorted(sorted_unique, addresses), sorted_unique.size - 1)
    return sorted_unique[at] == addresses


def _same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _width(shape: tuple[int, ...]) -> tuple[int, int]:
    return max(shape), int(np.prod(shape))


def _nonempty(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return [(name, t) for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.numel() > 0]


def _missing(tensors: dict[str, torch.Tensor], touched: np.ndarray) -> list[str]:
    missing = []
    for name, tensor in _nonempty(tensors):
        addresses = element_addresses(tensor)
        untouched = int((~_within(addresses, touched)).sum())
        if untouched:
            missing.append(f"{name}: {untouched} of {addresses.size} elements")
    return missing


TRAFFIC = TrafficRecorder()
