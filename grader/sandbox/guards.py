"""Protections installed in a worker process before any student module is imported.

They cannot stop a determined attacker who runs arbitrary code in the same process, and they need not: verdicts are
reached in the grader's process. They make the rules of the assignment (no reference, no library shortcut, no
torch DDP/FSDP) into clear failures instead of silent successes.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grader.sandbox import allowed_ops
from grader.sandbox.triton_traffic import TRAFFIC


class ForbiddenImport(ImportError):
    pass


class _BlockPackage(importlib.abc.MetaPathFinder):
    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name or fullname.startswith(self.name + "."):
            raise ForbiddenImport(f"student code may not import the reference package {self.name!r}")
        return None


class _RefuseImport(importlib.abc.MetaPathFinder):
    """Refuses to import a library package that the assignment reimplements."""

    def __init__(self, name: str, why: str):
        self.name, self.why = name, why

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name or fullname.startswith(self.name + "."):
            raise ForbiddenModuleUsed(f"{self.name} may not be used: {self.why}")
        return None


def block_reference(package_name: str | None, directory: Path | None) -> None:
    """Refuse imports of the reference package (by name, unless None) and any file access below its directory (when
    the process can reach it: without a bwrap sandbox), for the process' life. The audit hook cannot be removed once
    added, so student code cannot undo it; a child process is not bound by it, which is why the sandbox matters.
    """
    if package_name is not None:
        sys.meta_path.insert(0, _BlockPackage(package_name))
    if directory is None:
        return
    root = str(directory.resolve())

    def audit(event: str, args: tuple) -> None:
        if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes, Path)):
            target = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
            try:
                resolved = str(Path(target).resolve())
            except (OSError, RuntimeError):
                return
            if resolved == root or resolved.startswith(root + "/"):
                raise PermissionError(f"student code may not read the reference ({resolved})")

    sys.addaudithook(audit)


class ForbiddenOpRecorder(TorchDispatchMode):
    """Records which of the given aten operators were called while active (any route: torch.x, Tensor.x, F.x), in
    this thread and, once `record_every_thread()` ran, in every thread started from Python. With `allow_only`, it
    also records in `computed` every operator outside that allowlist that Triton's own code did not call, and every
    read of tensor values into Python or numpy (see grader.sandbox.allowed_ops), and shows torch's copies to the
    Triton traffic recorder (grader.sandbox.triton_traffic)."""

    def __init__(self, op_names: tuple[str, ...], allow_only: frozenset[str] | None = None):
        super().__init__()
        self.packets = {}
        for name in op_names:
            namespace, _, op = name.partition(".")
            packet = getattr(getattr(torch.ops, namespace), op, None)
            if packet is not None:
                self.packets[packet] = name
        self.allow_only = allow_only
        self.seen: list[str] = []
        self.computed: list[str] = []

    def note(self, func) -> None:
        name = self.packets.get(func.overloadpacket)
        if name is not None and name not in self.seen:
            self.seen.append(name)
        if self.allow_only is not None and str(func.overloadpacket) not in self.allow_only:
            self.note_computed(str(func.overloadpacket))

    def note_computed(self, what: str) -> None:
        if what not in self.computed and len(self.computed) < 8 and not allowed_ops.called_by_triton():
            self.computed.append(what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.note(func)
        out = func(*args, **(kwargs or {}))
        if self.allow_only is not None:
            TRAFFIC.note_op(str(func.overloadpacket), args, kwargs or {}, out)
        return out

    def __enter__(self):
        _ACTIVE_RECORDERS.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE_RECORDERS.remove(self)
        return super().__exit__(*exc)


@contextlib.contextmanager
def torch_compute_allowed():
    """Inside the block, the active recorders note forbidden operators but no longer hold torch to the allowlist: the
    backward of the attention family's chunked forms may compute in torch, their forward may not."""
    paused = [(recorder, recorder.allow_only) for recorder in _ACTIVE_RECORDERS if recorder.allow_only is not None]
    for recorder, _ in paused:
        recorder.allow_only = None
    try:
        yield
    finally:
        for recorder, allow_only in paused:
            recorder.allow_only = allow_only


# Dispatch modes are per thread. Other threads forward every operator to the recorders active at that moment.
_ACTIVE_RECORDERS: list[ForbiddenOpRecorder] = []


def note_computed_at_dispatcher(op_name: str) -> None:
    """What grader.sandbox.dispatch_gate's kernels call for each operator outside the allowlist: noted in every
    active allowlist recorder, whether or not Python dispatch reached them."""
    for recorder in _ACTIVE_RECORDERS:
        if recorder.allow_only is not None:
            recorder.note_computed(op_name)


def gate_compute_at_dispatcher() -> None:
    """Hold the allowlist below Python dispatch too, for the rest of the process (see grader.sandbox.dispatch_gate)."""
    from grader.sandbox import dispatch_gate

    dispatch_gate.install(note_computed_at_dispatcher)


class _ForwardToActiveRecorders(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for recorder in list(_ACTIVE_RECORDERS):
            recorder.note(func)
        return func(*args, **(kwargs or {}))


def watch_value_reads() -> None:
    """Make every read of a tensor's values into Python or numpy (`.numpy()`, `np.asarray(t)`, `.tolist()`, and the
    same through its storage: `t.untyped_storage().tolist()`, `storage[i]`) known to the allowlist recorders active at
    that moment (`.item()` is an operator, aten._local_scalar_dense)."""
    readers = [(torch.Tensor, name) for name in ("numpy", "__array__", "tolist")]
    readers += [(storage, name) for storage in (torch.UntypedStorage, torch.TypedStorage)
                for name in ("tolist", "__getitem__")]
    for owner, name in readers:
        original = getattr(owner, name)

        def reading(self, *args, _original=original, _name=f"{owner.__name__}.{name}()", **kwargs):
            for recorder in list(_ACTIVE_RECORDERS):
                if recorder.allow_only is not None:
                    recorder.note_computed(_name)
            return _original(self, *args, **kwargs)

        setattr(owner, name, reading)


def record_every_thread(student_dir: Path) -> None:
    """Every Python thread started from now on runs under the forwarding mode, and a thread started from a file
    below `student_dir` is marked as the student's (see `student_threads`)."""
    run, start = threading.Thread.run, threading.Thread.start

    def recorded_run(self):
        with _ForwardToActiveRecorders():
            return run(self)

    def marked_start(self):
        frame = sys._getframe(1)
        while frame is not None:
            if Path(frame.f_code.co_filename).is_relative_to(student_dir):
                self._grader_started_by_student = True
                break
            frame = frame.f_back
        return start(self)

    threading.Thread.run = recorded_run
    threading.Thread.start = marked_start


def student_threads() -> list[threading.Thread]:
    """Threads started by student code that are still running."""
    return [t for t in threading.enumerate() if getattr(t, "_grader_started_by_student", False) and t.is_alive()]


class ForbiddenModuleUsed(RuntimeError):
    pass


def forbid_torch_data_parallel() -> None:
    """Make torch's own DDP and FSDP wrappers raise when constructed, and torch's activation checkpointing when
    called."""
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.fsdp as fsdp
    import torch.distributed.nn.functional as distributed_nn_functional
    import torch.distributed.optim as distributed_optim
    import torch.nn.parallel as parallel

    def refuse(cls_name: str):
        def __init__(self, *args, **kwargs):
            raise ForbiddenModuleUsed(f"{cls_name} may not be used: implement data parallelism yourself")

        return __init__

    def refuse_call(name: str):
        def refused(*args, **kwargs):
            raise ForbiddenModuleUsed(f"{name} may not be used: write the collectives' backward yourself")

        return refused

    parallel.DistributedDataParallel.__init__ = refuse("torch.nn.parallel.DistributedDataParallel")
    fsdp.FullyShardedDataParallel.__init__ = refuse("torch.distributed.fsdp.FullyShardedDataParallel")
    distributed_optim.ZeroRedundancyOptimizer.__init__ = refuse("torch.distributed.optim.ZeroRedundancyOptimizer")
    # DTensor, parallelize_module (tensor and sequence parallelism) and fully_shard all start from a DeviceMesh.
    device_mesh.DeviceMesh.__init__ = refuse("torch.distributed.device_mesh.DeviceMesh (torch.distributed.tensor)")
    # torch's pipeline schedules: refused at import, since importing the package alone takes about a second.
    sys.meta_path.insert(0, _RefuseImport("torch.distributed.pipelining", "implement the pipeline schedules yourself"))
    # torch.distributed.nn's collectives come with their backward already written (the f/g pairs of the problems).
    for name, value in vars(distributed_nn_functional).items():
        if isinstance(value, type) and issubclass(value, torch.autograd.Function) and value.__module__ == (
            distributed_nn_functional.__name__
        ):
            value.forward = staticmethod(refuse_call(f"torch.distributed.nn.functional ({name})"))
    forbid_torch_checkpoint()


def forbid_torch_checkpoint() -> None:
    """Make torch's activation checkpointing raise: parallel.activation_checkpointing reimplements it. Replaced in the
    module before student code imports from it, and at the entry points both of its variants go through."""
    import torch.utils.checkpoint as checkpoint

    def refuse(name: str):
        def refused(*args, **kwargs):
            raise ForbiddenModuleUsed(f"{name} may not be used: implement activation checkpointing yourself")

        return refused

    for name in ("checkpoint", "checkpoint_sequential", "_checkpoint_without_reentrant_generator"):
        setattr(checkpoint, name, refuse(f"torch.utils.checkpoint.{name}"))
    checkpoint.CheckpointFunction.forward = staticmethod(refuse("torch.utils.checkpoint.CheckpointFunction"))


class Tampering:
    """What the worker's recorders are made of, captured before student code is imported, so that a student module
    that replaces them (through `__main__` or `grader.sandbox.*`) is noticed after the call. An in-process check: it
    catches the direct patch, not an attacker who also defeats this check."""

    def __init__(self, *holders: object):
        self.holders = holders
        self.captured = self.snapshot()

    def snapshot(self) -> dict[str, object]:
        parts = {}
        for holder in self.holders:
            for name, value in list(vars(holder).items()):
                if callable(value) or isinstance(value, (staticmethod, classmethod)):
                    parts[f"{getattr(holder, '__name__', holder)}.{name}"] = value
        return parts

    def changed(self) -> list[str]:
        now = self.snapshot()
        names = self.captured.keys() | now.keys()
        return sorted(name for name in names if self.captured.get(name) is not now.get(name))
