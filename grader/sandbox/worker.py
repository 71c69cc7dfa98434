"""The worker process: imports one student module and runs calls into it on the grader's behalf.

Started by `grader.sandbox.client.Sandbox` as `python -m grader.sandbox.worker FD`, where FD is its end of a socket
pair. It reads a start message (which package and problem, which reference to hide), installs the guards, imports
the student module, then answers requests until the socket closes.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import functools
import importlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from grader.sandbox import gpu_kernels, guards
from grader.sandbox.allowed_ops import ALLOWED_OPS
from grader.sandbox.triton_traffic import TRAFFIC
from grader.sandbox.wire import decode, encode, to_plain
from grader.session import backend
from grader.session.packages import PackageSpec, load_problem_module
from grader.speed import timing


def raised_in(error: BaseException, directory: Path | None) -> bool:
    """Whether the innermost frame of the error's traceback is a file below `directory`."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or directory is None:
        return False
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(directory)


def describe_exception(error: BaseException, impl_dir: Path | None = None) -> dict:
    lines = "".join(traceback.format_exception(type(error), error, error.__traceback__)).splitlines()
    tail = "\n".join(lines[-25:])
    # torch raises NotImplementedError for operators missing on a device: only the student's own `raise
    # NotImplementedError` (a stub) means "not implemented".
    stub = isinstance(error, NotImplementedError) and raised_in(error, impl_dir)
    kind = "not_implemented" if stub else "exception"
    return {
        "status": "error",
        "kind": kind,
        "type_names": [cls.__name__ for cls in type(error).__mro__],
        "message": f"{type(error).__name__}: {error}",
        "traceback": tail,
    }


class Worker:
    def __init__(self, start: dict):
        self.forbidden_ops = tuple(start.get("forbidden_ops", ()))
        # A Triton problem's calls may use torch only to allocate, view and copy (grader.sandbox.allowed_ops).
        self.allow_only = ALLOWED_OPS if start.get("uses_triton") else None
        if self.allow_only is not None:
            guards.watch_value_reads()
            guards.gate_compute_at_dispatcher()
        self.launches = None
        if backend.interpreting() or start.get("uses_triton"):
            from grader.sandbox import triton_hooks

            triton_hooks.install_all()
            self.launches = triton_hooks.LAUNCHES
        if start.get("forbid_torch_data_parallel"):
            guards.forbid_torch_data_parallel()
        impl = PackageSpec.from_json(start["impl"])
        guard_reference(start["reference"], impl)
        guards.record_every_thread(impl.path)
        self.tampering = guards.Tampering(
            guards, guards.ForbiddenOpRecorder, guards._ForwardToActiveRecorders, threading.Thread, Worker,
            sys.modules[__name__], timing, timing.Timer, gpu_kernels,
            *((triton_hooks_module(), type(self.launches)) if self.launches is not None else ()),
        )
        self.impl_dir = impl.path
        self.timer = None
        self.last_output = None
        self.module = load_problem_module(impl, start["problem"])

    def call(self, request: dict):
        function = getattr(self.module, request["function"], None)
        if function is None:
            raise AttributeError(f"the module defines no {request['function']!r}")
        args, kwargs = request.get("args", ()), request.get("kwargs", {})
        grad = request.get("grad")
        if grad is not None:
            args = [a.detach().requires_grad_(True) if i in grad["inputs"] else a for i, a in enumerate(args)]
        inputs = {**{f"argument {i}": a for i, a in enumerate(args)}, **kwargs}
        # Copies of the tensor inputs, which a correct call leaves as they were: an implementation that writes its
        # result (or scratch) into an input would corrupt its caller's tensor.
        before = {name: a.detach().clone() for name, a in inputs.items() if isinstance(a, torch.Tensor)}
        # A Triton problem's call also records what its launches touched: the evidence checked below.
        traffic = TRAFFIC.recording() if self.allow_only is not None else contextlib.nullcontext()
        with self.watched() as observed, traffic:
            value = function(*args, **kwargs)
            grads = None
            if grad is not None:
                forward_launches = len(self.launches.names) if self.launches is not None else 0
                grads = self.backward(value, args, grad)
        if grad is not None:
            # The backward's launches apart from the forward's: each pass must run the student's kernels.
            launches = observed["launches"]
            observed["launches"] = launches[:forward_launches]
            observed["backward_launches"] = launches[forward_launches:]
        observed["modified"] = [name for name, copy in before.items() if not unchanged(inputs[name], copy)]
        # An empty tensor has nothing to compute: no launch is needed for it.
        observed["empty_input"] = any(copy.numel() == 0 for copy in before.values())
        if self.allow_only is not None:
            upstream = {f"upstream gradient {i}": u for i, u in enumerate(grad["upstream"] if grad else ())}
            observed["unread"] = TRAFFIC.unread({**inputs, **upstream})
            observed["unwritten"] = TRAFFIC.unwritten(outputs_by_name(value, grads, grad))
        return {"status": "ok", "value": to_plain(value), "grads": grads, **observed}

    @contextlib.contextmanager
    def watched(self, gpu_traced: bool = True):
        """Records the Triton launches and forbidden operators of the code inside; fills the yielded dict with them.
        `gpu_traced=False` leaves out the GPU trace: the timer's own kernels (its spin, its cache flush) run inside."""
        if self.launches is not None:
            self.launches.reset()
        recorder = guards.ForbiddenOpRecorder(self.forbidden_ops, self.allow_only)
        observed = {}
        # On a GPU, a Triton problem's call is also traced by the GPU's own activity records (see gpu_kernels).
        gpu_trace = [] if gpu_traced and self.allow_only is not None and torch.cuda.is_available() else None
        with recorder, gpu_kernels.traced(gpu_trace) if gpu_trace is not None else contextlib.nullcontext():
            yield observed
        observed["gpu_kernels"] = gpu_trace
        observed["launches"] = list(self.launches.names) if self.launches is not None else []
        observed["forbidden"] = recorder.seen
        observed["computed"] = recorder.computed
        observed["left_running"] = left_running()
        observed["tampered"] = self.tampering.changed()

    @staticmethod
    def backward(value, args, grad: dict):
        """Backpropagate the grader's upstream gradients through the outputs that have one."""
        outputs = list(value) if isinstance(value, (tuple, list)) else [value]
        pairs = [
            (out, up)
            for out, up in zip(outputs, grad["upstream"])
            if up is not None and isinstance(out, torch.Tensor) and out.requires_grad
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [u for _, u in pairs])
        return [None if args[i].grad is None else args[i].grad.detach() for i in grad["inputs"]]

    def time(self, request: dict):
        """Time one call of the student's function on inputs built by a grader program; keep the output to sample."""
        module_name, _, function_name = request["inputs"].partition(":")
        make_inputs = getattr(importlib.import_module(module_name), function_name)
        args = make_inputs(*request["case"], seed=request["seed"], device=torch.device("cuda"))
        function = getattr(self.module, request["function"])
        if request.get("harness"):
            module_name, _, harness_name = request["harness"].partition(":")
            function = functools.partial(getattr(importlib.import_module(module_name), harness_name), function)
        if self.timer is None:
            self.timer = timing.Timer(torch.device("cuda"))
        if not request["check_rules"]:
            # Timed calls run bare: the operator recorder's Python overhead would delay the launch and count as
            # kernel time. The rules are checked on the untimed warm-up calls (and in every correctness test); only
            # whether the timer or the recorders were replaced is checked here too, after the timing.
            milliseconds, self.last_output = self.timer.time_ms(function, args)
            return {"status": "ok", "value": milliseconds, "launches": ["(not recorded)"], "forbidden": [],
                    "tampered": self.tampering.changed()}
        with self.watched(gpu_traced=False) as observed:
            milliseconds, self.last_output = self.timer.time_ms(function, args)
        return {"status": "ok", "value": milliseconds, **observed}

    def sample(self, request: dict):
        return {"status": "ok", "value": timing.sample(self.last_output, request["seed"])}

    def program(self, request: dict):
        module_name, _, function_name = request["target"].partition(":")
        program = getattr(importlib.import_module(module_name), function_name)
        value = program(self.module, *request.get("args", ()), **request.get("kwargs", {}))
        return {"status": "ok", "value": to_plain(value)}

    def handle(self, request: dict) -> dict:
        try:
            return getattr(self, request["op"])(request)
        except BaseException as error:  # every student failure is reported, none kills the worker
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise
            return describe_exception(error, self.impl_dir)


def outputs_by_name(value, grads: list | None, grad: dict | None) -> dict:
    """The tensors a call returned and the gradients its backward gave, by the names a message uses for them."""
    outputs = list(value) if isinstance(value, (tuple, list)) else [value]
    named = {("the output" if len(outputs) == 1 else f"output {i}"): out for i, out in enumerate(outputs)}
    for index, gradient in zip(grad["inputs"] if grad else (), grads or ()):
        named[f"the gradient of argument {index}"] = gradient
    return named


def unchanged(now: torch.Tensor, before: torch.Tensor) -> bool:
    """Same shape, dtype and values, NaN where NaN was."""
    if now.shape != before.shape or now.dtype != before.dtype:
        return False
    with torch.no_grad():
        same = now.detach() == before
        if before.is_floating_point() or before.is_complex():
            same |= now.detach().isnan() & before.isnan()
        return bool(same.all())


def triton_hooks_module():
    from grader.sandbox import triton_hooks

    return triton_hooks


def guard_reference(reference: dict, impl: PackageSpec) -> None:
    """Refuse the reference by name (unless the graded package has its name: a copy of it, say) and, where its
    directory is reachable (no bwrap sandbox), by path."""
    path = Path(reference["path"]) if reference["path"] else None
    if path is not None and path == impl.path:
        return  # grading the reference itself
    guards.block_reference(reference["name"] if reference["name"] != impl.name else None, path)


PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> None:
    """Become the subreaper of everything student code starts: a detached daemon stays our descendant."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def descendants(pid: int) -> list[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def left_running() -> list[str]:
    """Processes and threads student code left running after a call; the processes are killed."""
    time.sleep(0)  # let threads that are finishing finish
    left = [f"thread {t.name!r}" for t in guards.student_threads()]
    for pid in descendants(os.getpid()):
        left.append(f"process {pid} ({command_line(pid)[:80]})")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def serve(connection: Connection) -> None:
    start = decode(connection.recv_bytes())
    try:
        worker = Worker(start)
    except BaseException as error:  # noqa: BLE001 - an import failure is the student's, reported as such
        reply = describe_exception(error, PackageSpec.from_json(start["impl"]).path)
        reply["status"] = "import_error"
        connection.send_bytes(encode(reply))
        return
    connection.send_bytes(encode({"status": "ready"}))
    while True:
        try:
            data = connection.recv_bytes()
        except EOFError:
            return
        reply = worker.handle(decode(data))
        try:
            payload = encode(reply)
        except Exception as error:  # noqa: BLE001 - e.g. a value torch.save cannot write
            payload = encode(describe_exception(error))
        connection.send_bytes(payload)


def main() -> None:
    faulthandler.enable()
    adopt_orphans()
    sock = socket.socket(fileno=int(sys.argv[1]))
    connection = Connection(os.dup(sock.fileno()))
    sock.close()
    sys.path.insert(0, str(Path.cwd()))
    serve(connection)


if __name__ == "__main__":
    main()
