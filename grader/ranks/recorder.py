"""A recording wrapper around torch.distributed, installed in every rank before student code is imported.

Each collective or point-to-point call is appended to `CALLS` (its name, bytes, the bytes it sends to and receives
from peers, whether it was asynchronous, the grader program's phase when it was issued and, for an asynchronous one,
the phase when its handle or the handle's future was first waited on) and written to the rank's progress file as it
starts. When ranks hang, the progress files say which ranks never reached the call the others are waiting in.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C import _distributed_c10d as c10d_bindings

OPERATIONS = (
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
    "send", "recv", "isend", "irecv", "batch_isend_irecv",
    # Newer torch's names for all_gather_into_tensor and reduce_scatter_tensor, which it implements by calling them:
    # a call through the old name is then recorded twice, the inner record marked nested.
    "all_gather_single", "reduce_scatter_single",
)

# Beneath those functions: the process group's (and its backends') own methods, and the functional collectives.
# torch's functions call the methods themselves, from inside a recorded call, so only a call made outside every
# recorded call is recorded: the program's own, under its qualified name (point-to-point ones under send and recv),
# so that neither "collectives from send and recv only" nor a collective pattern can be bypassed through them.
PROCESS_GROUP_METHODS = (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "_allgather_base", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced", "gather", "scatter",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base", "all_to_all_single", "barrier",
    "send", "recv", "recv_anysource",
)
PROCESS_GROUP_POINT_TO_POINT = {"send": "send", "recv": "recv", "recv_anysource": "recv"}
FUNCTIONAL_COLLECTIVES = (
    "all_reduce", "all_reduce_inplace", "all_reduce_coalesced", "all_gather_tensor", "all_gather_tensor_autograd",
    "all_gather_tensor_inplace", "all_gather_inplace", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd", "reduce_scatter_tensor_inplace", "reduce_scatter_tensor_coalesced",
    "all_to_all_single", "all_to_all_single_autograd", "all_to_all_inplace", "broadcast", "permute_tensor",
)
# The dispatcher's own communication ops, beneath all of the above: torch.ops.c10d.allreduce_(...) reaches the process
# group through no Python function of torch.distributed. Recorded as the methods are, under their qualified names
# (point-to-point ones as send and recv); waiting on a tensor and checking for NaN are not communication.
DISPATCHER_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
DISPATCHER_POINT_TO_POINT = {"send": "send", "recv_": "recv", "recv_any_source_": "recv", "isend": "send",
                             "irecv": "recv"}
NOT_COMMUNICATION = ("wait_tensor", "check_for_nan")


@dataclass
class Call:
    seq: int
    op: str
    bytes: int
    async_op: bool
    phase: str
    # Bytes this call sends to peers: a send's or isend's tensor, the isend operations of a batch_isend_irecv.
    sent: int = 0
    # Bytes this call receives from peers: a recv's or irecv's tensor, the irecv operations of a batch_isend_irecv.
    received: int = 0
    # Issued by torch from inside another recorded call (the isend under a send, under a batch_isend_irecv): count
    # only calls that are not nested, or a message is counted twice.
    nested: bool = False
    # The phase in which the program first waited on this call's Work (or on its future); None if it never did.
    # "Issued with async_op=True" alone does not show overlap: a handle waited on at once blocks like a plain call.
    waited: str | None = None
    # A broadcast's source, as a global rank (None for other calls, and for a process group's own method).
    src: int | None = None


CALLS: list[Call] = []  # since the last reset(), for the program's checks
# id() of each asynchronous call's Work, and of futures taken from one, -> (the object, kept alive so that its id is
# not reused, and its Call); since the last reset(). Work objects take no attributes and no weak references.
_handles: dict[int, tuple[object, Call]] = {}
_entered = 0  # every call of the rank's life, never reset: the progress file's sequence numbers
_phase = "other"
_progress = None
_depth = threading.local()  # how many recorded calls this thread is inside


def tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def point_to_point_bytes(name: str, first, direction: str) -> int:
    """The bytes a call named `name` with first operand `first` moves in `direction` ("send" or "recv"): its tensor
    for a send/isend (recv/irecv), the sum over the matching operations of a batch_isend_irecv."""
    if name in (direction, "i" + direction):
        return tensor_bytes(first)
    if name == "batch_isend_irecv" and isinstance(first, (list, tuple)):
        return sum(tensor_bytes(p.tensor) for p in first if getattr(p.op, "__name__", "") == "i" + direction)
    return 0


def broadcast_source(name: str, operands: tuple, kwargs: dict, beneath: bool) -> int | None:
    """The global rank a torch.distributed.broadcast call names as its source (`src`, or `group_src` in its group)."""
    if name != "broadcast" or beneath:
        return None
    try:
        if kwargs.get("group_src") is not None:
            group = kwargs.get("group") or dist.group.WORLD
            return dist.get_global_rank(group, kwargs["group_src"])
        source = kwargs.get("src", operands[1] if len(operands) > 1 else None)
        return int(source) if source is not None else None
    except (TypeError, ValueError, RuntimeError):
        return None  # the call itself will say what is wrong with its arguments


@contextlib.contextmanager
def phase(name: str):
    """Label the calls issued inside the block (e.g. "backward"), for checks such as overlap with backward."""
    global _phase
    previous, _phase = _phase, name
    try:
        yield
    finally:
        _phase = previous


def _call_recorded(name: str, function, args: tuple, kwargs: dict, beneath: bool, method: bool):
    """function(*args, **kwargs), recorded as `name`. `beneath`: one of the (asynchronous) calls under
    torch.distributed's functions, recorded only when called from outside them. `method`: its first argument is the
    process group."""
    global _entered
    depth = getattr(_depth, "value", 0)
    if beneath and depth > 0:
        return function(*args, **kwargs)
    _entered += 1
    operands = args[1:] if method else args
    first = operands[0] if operands else next(iter(kwargs.values()), None)
    call = Call(_entered, name, tensor_bytes(first), beneath or bool(kwargs.get("async_op", False)), _phase,
                point_to_point_bytes(name, first, "send"), point_to_point_bytes(name, first, "recv"), depth > 0,
                src=broadcast_source(name, operands, kwargs, beneath))
    CALLS.append(call)
    if _progress is not None:
        _progress.write(f"{call.seq} {name}\n")
        _progress.flush()
    _depth.value = depth + 1
    try:
        result = function(*args, **kwargs)
    finally:
        _depth.value = depth
    # batch_isend_irecv returns a list of handles, the dispatcher's ops a (tensors, handle) tuple
    for work in result if isinstance(result, (list, tuple)) else [result]:
        if isinstance(work, c10d_bindings.Work):
            _handles[id(work)] = (work, call)
    return result


def _wrap(name: str, function, beneath: bool = False, method: bool = False):
    """`function` recording its calls as `name` (see _call_recorded)."""

    @functools.wraps(function)
    def recorded(*args, **kwargs):
        return _call_recorded(name, function, args, kwargs, beneath, method)

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
    _install_beneath()
    _install_dispatcher_ops()
    _install_waits()


def _install_beneath() -> None:
    import torch.distributed._functional_collectives as functional

    for cls in (c10d_bindings.ProcessGroup, c10d_bindings.Backend, getattr(c10d_bindings, "ProcessGroupGloo", None),
                getattr(c10d_bindings, "ProcessGroupNCCL", None)):
        for method in PROCESS_GROUP_METHODS if cls is not None else ():
            original = vars(cls).get(method)  # defined on this class itself, not inherited
            if original is not None and not getattr(original, "__wrapped_by_grader__", False):
                name = PROCESS_GROUP_POINT_TO_POINT.get(method, f"{cls.__name__}.{method}")
                setattr(cls, method, _wrap(name, original, beneath=True, method=True))
    for function in FUNCTIONAL_COLLECTIVES:
        original = getattr(functional, function, None)
        if original is not None and not getattr(original, "__wrapped_by_grader__", False):
            setattr(functional, function, _wrap(f"_functional_collectives.{function}", original, beneath=True))


def _dispatcher_name(op) -> str | None:
    """The name a call of dispatcher op `op` (a packet or an overload) is recorded under; None if it is not one of the
    communication ops."""
    namespace, _, name = getattr(op, "_qualified_op_name", "").partition("::")
    if not name:
        namespace, name = getattr(op, "namespace", ""), getattr(op, "_opname", "")
    if namespace not in DISPATCHER_NAMESPACES or name in NOT_COMMUNICATION:
        return None
    return DISPATCHER_POINT_TO_POINT.get(name, f"torch.ops.{namespace}.{name}")


def _install_dispatcher_ops() -> None:
    """Calls of dispatcher ops made from Python (torch.ops.c10d.allreduce_(...) or its .default) are recorded by the op
    classes' own __call__. The ops themselves stay what torch.ops returns: torch's C++ looks them up there and relies
    on their type."""
    for cls in (torch._ops.OpOverloadPacket, torch._ops.OpOverload, getattr(torch._ops, "TorchBindOpOverload", None)):
        original = vars(cls).get("__call__") if cls is not None else None
        if original is None or getattr(original, "__wrapped_by_grader__", False):
            continue

        def call(self, /, *args, _original=original, **kwargs):
            name = _dispatcher_name(self)
            if name is None:
                return _original(self, *args, **kwargs)
            return _call_recorded(name, functools.partial(_original, self), args, kwargs, beneath=True, method=False)

        call.__wrapped_by_grader__ = True
        cls.__call__ = call


def _note_wait(handle) -> None:
    held = _handles.get(id(handle))
    if held is not None and held[0] is handle and held[1].waited is None:
        held[1].waited = _phase


def _install_waits() -> None:
    """Work.wait, Work.get_future and Future.wait note, on the Call a handle came from, the phase of its first wait."""
    work_wait, get_future, future_wait = c10d_bindings.Work.wait, c10d_bindings.Work.get_future, torch._C.Future.wait
    if getattr(work_wait, "__wrapped_by_grader__", False):
        return

    def wait(self, *args, **kwargs):
        _note_wait(self)
        return work_wait(self, *args, **kwargs)

    def future_of(self, *args, **kwargs):
        future = get_future(self, *args, **kwargs)
        held = _handles.get(id(self))
        if held is not None and held[0] is self:
            _handles[id(future)] = (future, held[1])
        return future

    def wait_future(self, *args, **kwargs):
        _note_wait(self)
        return future_wait(self, *args, **kwargs)

    for cls, name, replacement in ((c10d_bindings.Work, "wait", wait), (c10d_bindings.Work, "get_future", future_of),
                                   (torch._C.Future, "wait", wait_future)):
        replacement.__wrapped_by_grader__ = True
        setattr(cls, name, replacement)


def reset() -> None:
    CALLS.clear()
    _handles.clear()


def release_handles() -> None:
    """Stop watching for waits (the calls stay recorded): a Work the recorder keeps keeps its tensors alive, which a
    memory probe would count against the program."""
    _handles.clear()
