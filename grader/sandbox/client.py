"""The grader's handle on a worker process that runs one student module.

All student code runs in the worker; the grader's process only sends inputs and receives plain data back. A worker
that dies is reported as a crash and replaced on the next call; one that does not answer in time is killed with its
whole process group and reported as a timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

from grader.checks.inert import escaped, inert
from grader.checks.outcomes import (
    NotImplementedByStudent,
    RuleViolation,
    StudentAbort,
    StudentCrashed,
    StudentError,
    StudentTimedOut,
)
from grader.sandbox import gpu_kernels
from grader.sandbox.isolation import Isolation, Mounts
from grader.sandbox.wire import MAX_REPLY_BYTES, ReplyRefused, decode_reply, encode, read_tail, too_long
from grader.session.budget import TestBudget
from grader.session.packages import PackageSpec

START_TIMEOUT_S = 180.0


def kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def output_tail(path: Path, lines: int = 15) -> str:
    """The last lines a worker printed, inert (grader.checks.inert): escaped before they are split, so that only
    newlines end a line."""
    try:
        text = escaped(read_tail(path))
    except OSError:
        return ""
    return inert("\n".join(text.splitlines()[-lines:]))


def exit_description(returncode: int | None, through_bwrap: bool = False) -> str:
    """How a process ended. bwrap reports a sandboxed process killed by signal N as its own exit status 128 + N."""
    if returncode is None:
        return "exit status unknown"
    if through_bwrap and 128 < returncode < 128 + 65:
        returncode = 128 - returncode
    if returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def listed(names, separator: str = ", ") -> str:
    """Names a reply lists, joined, inert: student code in the worker could have written any of them."""
    return inert(separator.join(map(str, names)))


def check_triton_traffic(reply: dict, what: str, context: str = "") -> None:
    """The worker's evidence that the Triton launches read every input and wrote every output
    (grader.sandbox.triton_traffic)."""
    where = f" ({context})" if context else ""
    if reply.get("unwritten"):
        raise RuleViolation(f"{what} returned values that no Triton kernel wrote ({listed(reply['unwritten'], '; ')}): "
                            f"every output element must be stored by your kernels, or copied from a buffer they "
                            f"stored{where}")
    if reply.get("unread"):
        raise RuleViolation(f"{what}'s Triton kernels never read some of its inputs ({listed(reply['unread'], '; ')}): "
                            f"the kernels must load every input they compute from{where}")


def check_gpu_trace(reply: dict, what: str) -> None:
    """The GPU's own record of the call (grader.sandbox.gpu_kernels): every Triton kernel the launch hook reported
    ran on it, and nothing else computed there."""
    kernels = reply["gpu_kernels"]
    launched = reply["launches"] + reply.get("backward_launches", [])  # the trace spans both passes
    never_ran = sorted({name for name in launched if not gpu_kernels.ran(kernels, name)})
    if never_ran:
        raise RuleViolation(f"{what} reported launches of {listed(never_ran)} that the GPU never ran (its trace "
                            f"holds {listed(kernels[:4])})")
    others = gpu_kernels.computing(kernels, launched)
    if others:
        raise RuleViolation(f"{what} ran kernels other than its Triton kernels on the GPU "
                            f"({listed(others[:2], '; ')}): here torch may only allocate, view and copy tensors, "
                            "and the values are your kernels' work")


class ReplyConnection(Connection):
    """The grader's end of a worker's socket. `recv_bytes(maxlength)` refuses a longer message from its header, before
    reading its body, but says only "bad message length": this reads the header the same way and names the size."""

    def _recv_bytes(self, maxsize=None):
        size, = struct.unpack("!i", self._recv(4).getvalue())
        if size == -1:  # a message of 2 GiB or more: its size follows as 8 bytes
            size, = struct.unpack("!Q", self._recv(8).getvalue())
        if maxsize is not None and size > maxsize:
            raise ReplyRefused(too_long(size, maxsize))
        return self._recv(size)


def reference_as_seen(reference: PackageSpec, isolation: Isolation) -> dict:
    """What a student process is told of the reference: its name, to refuse importing it, and its path only where the
    process could otherwise reach the directory (no bwrap sandbox)."""
    return {"name": reference.name, "path": None if isolation.level == "bwrap" else str(reference.path)}


class Sandbox:
    """One student module in a worker process. Calls block until the worker answers or its time runs out."""

    def __init__(
        self,
        problem_id: str,
        impl: PackageSpec,
        reference: PackageSpec,
        *,
        isolation: Isolation,
        call_timeout_s: float,
        forbidden_ops: tuple[str, ...] = (),
        uses_triton: bool = False,
        forbid_torch_data_parallel: bool = False,
        stubs: frozenset[str] = frozenset(),
    ):
        self.problem_id = problem_id
        # Functions still the stub (grader.checks.stubs), and any that raised NotImplementedError since: calling one
        # again cannot give anything else, so it is answered here, without a round trip.
        self.not_implemented = set(stubs)
        self.isolation = isolation.fresh()  # a sandbox of its own: its own uid and control group
        self.mounts = Mounts(impl_dir=impl.path)
        self.start_message = {
            "problem": problem_id,
            "impl": PackageSpec(impl.name, isolation.impl_path(impl.path)).to_json(),
            "reference": reference_as_seen(reference, isolation),
            "forbidden_ops": list(forbidden_ops),
            "uses_triton": uses_triton,
            "forbid_torch_data_parallel": forbid_torch_data_parallel,
        }
        self.call_timeout_s = call_timeout_s
        self.uses_triton = uses_triton
        self.budget: TestBudget | None = None
        self.process: subprocess.Popen | None = None
        self.connection: Connection | None = None
        self.log = Path(tempfile.mkstemp(prefix=f"worker-{problem_id}-", suffix=".log")[1])

    # --- lifetime -------------------------------------------------------------------------------------------------

    def start(self) -> None:
        ours, theirs = socket.socketpair()
        with open(self.log, "ab") as log:
            # Its own process group (and, under bwrap, its own pid namespace), so a kill takes its children too.
            self.process = self.isolation.popen(
                [sys.executable, "-m", "grader.sandbox.worker", str(theirs.fileno())],
                self.mounts,
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        theirs.close()
        self.connection = ReplyConnection(ours.detach())
        self.connection.send_bytes(encode(self.start_message))
        reply = self.receive(START_TIMEOUT_S, "importing the module")
        if reply["status"] == "import_error":
            self.stop()
            if reply["kind"] == "not_implemented":
                raise NotImplementedByStudent("not implemented")
            raise StudentCrashed(f"importing {self.problem_id} failed: {inert(reply['message'])}\n"
                                 f"{inert(reply['traceback'])}")

    def stop(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None
        if self.process is not None:
            kill_group(self.process)
            self.process = None

    def close(self) -> None:
        """Stop the worker for good, give back its sandbox and remove its log (a restarted worker appends to the same
        log until then)."""
        self.stop()
        self.isolation.close()
        self.log.unlink(missing_ok=True)

    def begin_test(self, budget: TestBudget) -> None:
        """Every test has a budget of student time (see grader.session.budget); calls after it is spent time out at
        once."""
        self.budget = budget

    def __repr__(self) -> str:
        # Hypothesis prints a failing test's arguments: name the problem, not a process handle.
        return f"<student {self.problem_id}>"

    @contextlib.contextmanager
    def describing(self, inputs: str):
        """Name the inputs in any crash, timeout or error raised inside the block."""
        try:
            yield
        except StudentAbort as abort:
            if abort.status != "not implemented":
                abort.message = f"{abort.message}\ninputs: {inputs}"
                abort.args = (abort.message,)
            raise
        except StudentError as error:
            error.args = (f"{error.args[0]}\ninputs: {inputs}",)
            raise

    # --- calls ----------------------------------------------------------------------------------------------------

    def call(self, function: str, *args, **kwargs):
        """The student's `function(*args, **kwargs)`; raises StudentError if it raised."""
        return self.call_traced(function, *args, **kwargs)["value"]

    def call_beside(self, grader_work, function: str, *args, grad: dict | None = None,
                    **kwargs) -> tuple[dict, object]:
        """(call_traced(function, *args, grad=grad, **kwargs), grader_work()): the grader's own work on the same inputs
        (the reference's answer, its yardstick) runs while the worker computes instead of after it, which hides the
        reference's Triton compiles on a GPU and its interpreter time on a CPU of two cores or more."""
        what = f"{function}()"
        reply, grader_value = self._request_beside(
            grader_work, {"op": "call", "function": function, "args": list(args), "kwargs": kwargs, "grad": grad},
            what, function)
        self.enforce_rules(reply, what)
        return reply, grader_value

    def call_traced(self, function: str, *args, grad: dict | None = None, **kwargs) -> dict:
        """Like call, with what the worker observed: Triton launches, forbidden operators, gradients."""
        return self.call_beside(None, function, *args, grad=grad, **kwargs)[0]

    def enforce_rules(self, reply: dict, what: str) -> None:
        if reply.get("tampered"):
            raise RuleViolation(f"{what} modified the grader's code in the worker ({listed(reply['tampered'][:4])})")
        if reply.get("left_running"):
            raise RuleViolation(
                f"{what} left {listed(reply['left_running'])} running after it returned: a call must finish its work"
            )
        if reply.get("modified"):
            raise RuleViolation(f"{what} changed its input ({listed(reply['modified'])}) in place: leave every "
                                "input as it was given")
        if reply["forbidden"]:
            raise RuleViolation(
                f"{what} called {listed(reply['forbidden'])}: this problem is to reimplement that operator"
            )
        launches_needed = self.uses_triton and not reply.get("empty_input")
        if launches_needed and not reply["launches"]:
            raise RuleViolation(f"{what} launched no Triton kernel: the work must be done by your Triton kernel")
        if launches_needed and reply.get("backward_launches") == []:
            raise RuleViolation(f"the backward of {what} launched no Triton kernel: it must be yours, in Triton")
        if reply.get("computed") and not reply.get("empty_input"):
            raise RuleViolation(f"{what} computed with {listed(reply['computed'])} outside a Triton kernel: here "
                                "torch may only allocate, view and copy tensors, and the values are your kernels' work")
        if launches_needed and reply.get("gpu_kernels") is not None:
            check_gpu_trace(reply, what)
        if not reply.get("empty_input"):
            check_triton_traffic(reply, what)

    def time_call(self, function: str, inputs: str, case: tuple, seed: int, check_rules: bool,
                  harness: str | None = None) -> float:
        """Milliseconds of one GPU call of the student's function on inputs `inputs(*case, seed=seed)` (through
        `harness(function, *inputs)` if given, a grader function named like `inputs`); with check_rules, the call is
        also watched for forbidden operators and Triton launches (which slows it)."""
        what = f"{function}()"
        reply = self.request(
            {"op": "time", "function": function, "inputs": inputs, "case": list(case), "seed": seed,
             "check_rules": check_rules, "harness": harness},
            what,
            function,
        )
        self.enforce_rules(reply, what)
        return reply["value"]

    def sample_last_output(self, seed: int):
        return self.request({"op": "sample", "seed": seed}, "sampling the timed output")["value"]

    def raises(self, function: str, *args, **kwargs) -> StudentError | None:
        """What the student's `function(*args, **kwargs)` raised (None if it returned)."""
        try:
            self.request({"op": "call", "function": function, "args": list(args), "kwargs": kwargs}, f"{function}()",
                         function)
        except StudentError as error:
            return error
        return None

    def run_program(self, target: str, *args, **kwargs):
        """Run grader code `module:function(student_module, *args, **kwargs)` inside the worker."""
        return self.request({"op": "program", "target": target, "args": list(args), "kwargs": kwargs}, target)["value"]

    def run_program_beside(self, grader_work, target: str, *args, **kwargs) -> tuple:
        """(run_program(target, *args, **kwargs), grader_work()), the two running at the same time."""
        reply, grader_value = self._request_beside(
            grader_work, {"op": "program", "target": target, "args": list(args), "kwargs": kwargs}, target)
        return reply["value"], grader_value

    def request(self, message: dict, what: str, function: str | None = None) -> dict:
        """Send one request and wait for its reply; `function` names the student function it calls, if it is one."""
        return self._request_beside(None, message, what, function)[0]

    def send(self, message: dict) -> bytes:
        """Encode one request and send it to the worker; the bytes sent."""
        data = encode(message)
        self.connection.send_bytes(data)
        return data

    def _time_left(self, sent_s: float) -> tuple[float, str]:
        """How much longer the request sent at `sent_s` may take, and how to say so when it runs out."""
        timeout = self.call_timeout_s - (time.monotonic() - sent_s)
        limit = f"within {self.call_timeout_s:.0f} s"
        if self.budget is not None and self.budget.remaining_s() < timeout:
            timeout, limit = self.budget.remaining_s(), f"before {self.budget.spent_message()}"
        return timeout, limit

    def _request_beside(self, grader_work, message: dict, what: str,
                        function: str | None = None) -> tuple[dict, object]:
        if function in self.not_implemented:
            raise NotImplementedByStudent("not implemented")
        if self._time_left(time.monotonic())[0] <= 0:
            raise StudentTimedOut(f"{what} was not started: {self.budget.spent_message()}")
        if self.process is None:
            self.start()
        sent_s = time.monotonic()
        self.send(message)
        grader_value = None
        if grader_work is not None:
            try:
                grader_value = grader_work()
            except BaseException:
                self.stop()  # its reply would answer the next request
                raise
        timeout, limit = self._time_left(sent_s)
        note = self.budget.reference_note(function or what) if self.budget is not None else ""
        reply = self.receive(max(timeout, 0.0), what, limit, note)
        if reply["status"] == "error":
            if reply["kind"] == "not_implemented":
                if function is not None:
                    self.not_implemented.add(function)
                raise NotImplementedByStudent("not implemented")
            raised = inert(reply["message"])
            raise StudentError(f"{what} raised {raised}\n{inert(reply['traceback'])}",
                               tuple(inert(name) for name in reply["type_names"]), raised)
        return reply, grader_value

    def receive(self, timeout_s: float, what: str, limit: str = "", note: str = "") -> dict:
        limit = limit or f"within {timeout_s:.0f} s"
        try:
            ready = self.connection.poll(timeout_s)
            if not ready:
                self.stop()
                raise StudentTimedOut(f"{what} did not return {limit} (worker killed){note}")
            return decode_reply(self.connection.recv_bytes(MAX_REPLY_BYTES))
        except ReplyRefused as refusal:
            self.stop()  # what it sends next would answer the next request
            raise StudentCrashed(f"{what} sent back {inert(refusal)} (refused; the worker was stopped)") from None
        except (EOFError, OSError, ConnectionError):
            time.sleep(0.2)  # let the process finish dying so its exit status is known
            code = self.process.poll() if self.process else None
            tail = output_tail(self.log)
            self.stop()
            raise StudentCrashed(
                f"the worker process running {what} died ({exit_description(code, self.isolation.level == 'bwrap')})"
                + (f"; its last output:\n{tail}" if tail else "")
            ) from None
        except BaseException:
            # Interrupted while the worker was busy (the grader's own time limit, Ctrl-C): its reply would answer
            # the next request, so the worker goes; the next call starts a fresh one.
            self.stop()
            raise
