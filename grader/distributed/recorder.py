"""A recording wrapper around torch.distributed, installed in every rank before student code is imported.

Each collective or point-to-point call is appended to `CALLS` (its name, bytes, whether it was asynchronous and whether
it was issued while the grader's program was in its backward phase) and written to the rank's progress file as it
starts. When ranks hang, the progress files say which ranks never reached the call the others are waiting in.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

OPERATIONS = (
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
    "send", "recv", "isend", "irecv", "batch_isend_irecv",
)  # fmt: skip


@dataclass
class Call:
    seq: int
    op: str
    bytes: int
    async_op: bool
    phase: str


CALLS: list[Call] = []  # since the last reset(), for the program's checks
_entered = 0  # every call of the rank's life, never reset: the progress file's sequence numbers
_phase = "other"
_progress = None


def tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


@contextlib.contextmanager
def phase(name: str):
    """Label the calls issued inside the block (e.g. "backward"), for checks such as overlap with backward."""
    global _phase
    previous, _phase = _phase, name
    try:
        yield
    finally:
        _phase = previous


def _wrap(name: str, function):
    @functools.wraps(function)
    def recorded(*args, **kwargs):
        global _entered
        _entered += 1
        first = args[0] if args else next(iter(kwargs.values()), None)
        call = Call(_entered, name, tensor_bytes(first), bool(kwargs.get("async_op", False)), _phase)
        CALLS.append(call)
        if _progress is not None:
            _progress.write(f"{call.seq} {name}\n")
            _progress.flush()
        return function(*args, **kwargs)

    recorded.__wrapped_by_grader__ = True
    return recorded


def install(progress_file: Path) -> None:
    global _progress
    _progress = open(progress_file, "a", buffering=1)
    for name in OPERATIONS:
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "__wrapped_by_grader__", False):
            continue
        wrapped = _wrap(name, original)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)


def reset() -> None:
    CALLS.clear()
