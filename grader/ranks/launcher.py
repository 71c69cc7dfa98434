"""Launchers run one program on `world_size` ranks and bring back each rank's result.

Every launcher starts the same trusted host process (`grader.ranks.host`), which puts all ranks of the launch
into one sandbox (see grader.sandbox.isolation) and hands each rank its own inputs on a file descriptor. They share
one protocol through a run directory: in `shared/` (the only part the sandbox sees) the job description `job.pt` and,
from each rank, a progress file (one line per collective it entered), a result file (a torch.save of plain data,
loaded with weights_only=True) and its exit status. So the verdict never depends on unpickling what student processes
wrote, and a hang can be explained from the progress files whichever launcher ran the ranks. What a rank returns is
forgeable: graders compare it with what they compute themselves.

- `LocalLauncher`: the host process on this machine (gloo on CPU; NCCL when every rank has a GPU).
- `SubmititLauncher`: the host process as a submitit job (its local executor, or Slurm).
- `SrunLauncher`: inside a Slurm allocation, the host process as one job step.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grader.checks.inert import escaped, inert
from grader.checks.outcomes import (
    NotImplementedByStudent,
    StudentAbort,
    StudentCrashed,
    StudentError,
    StudentTimedOut,
)
from grader.ranks import GROUP_SETUP
from grader.ranks.host import group_sandbox, rank_data_fds
from grader.sandbox.client import exit_description, kill_group
from grader.sandbox.policy import SECRET_VARIABLES, without_secrets
from grader.sandbox.wire import ReplyRefused, decode_reply, encode, read_reply_file, read_tail
from grader.session.packages import PackageSpec

POLL_S = 0.05
# Once one rank has failed, how long the others get to finish before they are killed (they are usually blocked in a
# collective the failed rank will never join).
GRACE_S = 5.0


@dataclass
class RankJob:
    problem: str
    impl: PackageSpec
    reference: PackageSpec
    program: str  # "module:function", called as function(student_module, rank, world_size, *args, **kwargs)
    world_size: int
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    # Rank r alone receives rank_data[r], as the keyword argument rank_data: its own inputs, which no other rank (and
    # no shared argument) can rebuild, so that a correct result needs communication.
    rank_data: list | None = None
    timeout_s: float = 60.0
    collective_timeout_s: float = 90.0
    backend: str = "auto"
    isolation: str = "none"
    disable_userns: bool = True  # see grader.sandbox.isolation.Isolation
    extra_code: tuple[str, ...] = ()  # further read-only code folders the program needs (the grader's own tests)

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= self.world_size else "gloo"


def prepare_run_dir(job: RankJob, shared: Path | None = None) -> Path:
    """A run folder: `private/` (the launch's settings and each rank's own inputs, read by the trusted host process
    only) and `shared/` (the ranks' job, progress, logs and results: what the sandbox sees), or a link to `shared`
    where a long-lived group's sandbox already sees that folder."""
    run = Path(tempfile.mkdtemp(prefix=f"ranks-{job.problem}-"))
    (run / "private").mkdir()
    if shared is None:
        (run / "shared").mkdir()
    else:
        (run / "shared").symlink_to(shared)
    backend = job.resolved_backend()
    description = {
        "problem": job.problem,
        "impl_name": job.impl.name,
        "reference": {"name": job.reference.name, "path": str(job.reference.path)},
        "program": job.program,
        "args": list(job.args),
        "kwargs": job.kwargs,
        "world_size": job.world_size,
        "has_rank_data": job.rank_data is not None,
        "backend": backend,
        "collective_timeout_s": job.collective_timeout_s,
    }
    (run / "shared" / "job.pt").write_bytes(encode(description))
    host = {"impl": job.impl.to_json(), "isolation": job.isolation, "disable_userns": job.disable_userns,
            "gpu": backend == "nccl",
            "world_size": job.world_size, "extra_code": list(job.extra_code)}
    (run / "private" / "host.json").write_text(json.dumps(host))
    if job.rank_data is not None:
        if len(job.rank_data) != job.world_size:
            raise ValueError(f"rank_data holds {len(job.rank_data)} entries for {job.world_size} ranks")
        for rank, data in enumerate(job.rank_data):
            (run / "private" / f"rank{rank}.data.pt").write_bytes(encode(data))
    return run


def host_command(run: Path) -> list[str]:
    return [sys.executable, "-m", "grader.ranks.host", str(run)]


def last_progress(run: Path, rank: int) -> tuple[int, str]:
    """(sequence number, operation) of the last collective the rank entered; (0, "") if none."""
    try:
        lines = read_tail(run / "shared" / f"rank{rank}.progress").splitlines()
    except OSError:
        return 0, ""
    seq, _, op = lines[-1].partition(" ") if lines else ("0", "", "")
    return (int(seq), inert(op)) if seq.isdigit() else (0, "")  # a progress file rank code damaged tells nothing


def hang_diagnosis(run: Path, world_size: int, finished: set[int]) -> str:
    """Which ranks are stuck where, and which never arrived at the collective the furthest ranks wait in."""
    waiting = {r: last_progress(run, r) for r in range(world_size) if r not in finished}
    if not waiting:
        return "every rank finished"
    furthest = max(seq for seq, _ in waiting.values())
    if furthest == 0:
        return f"rank(s) {sorted(waiting)} entered no collective (stuck before the first one, or still starting)"
    stuck_op = next(op for seq, op in waiting.values() if seq == furthest)
    at_front = sorted(r for r, (seq, _) in waiting.items() if seq == furthest)
    behind = sorted(r for r in range(world_size) if r not in at_front)
    message = f"rank(s) {at_front} waited in collective #{furthest} ({stuck_op or 'none'})"
    if behind:
        detail = ", ".join(
            f"rank {r} " + ("had finished" if r in finished else f"stopped after #{last_progress(run, r)[0]}")
            for r in behind
        )
        message += f"; rank(s) {behind} never arrived ({detail})"
    return message


def read_reply(path: Path) -> dict:
    """A rank's result file as a reply; a file the rank's code damaged, or one past the limits on a reply
    (grader.sandbox.wire), reads as that rank's error."""
    try:
        reply = decode_reply(read_reply_file(path))
    except ReplyRefused as refusal:
        return rank_error("RefusedResult", f"{path.name} holds {refusal} (refused)")
    except OSError as error:
        return rank_error("CorruptResult", f"{path.name} could not be read ({error.strerror})")
    if isinstance(reply, dict) and reply.get("status") in ("ok", "error"):
        return reply
    return rank_error("CorruptResult", f"{path.name} is not a result the grader's rank program wrote")


def rank_error(type_name: str, message: str) -> dict:
    return {"status": "error", "kind": "exception", "type_names": [type_name], "traceback": "", "message": message}


def exit_codes_of(run: Path, world_size: int) -> dict[int, int | None]:
    """Each rank's exit status, as the launch's first process inside the sandbox recorded it (None: still running)."""
    codes = {}
    for rank in range(world_size):
        try:
            codes[rank] = int(read_tail(run / "shared" / f"rank{rank}.exit"))
        except (OSError, ValueError):
            codes[rank] = None
    return codes


def collect(run: Path, job: RankJob, exit_codes: dict[int, int | None], timed_out: bool) -> list:
    """Each rank's value, or the exception that describes what went wrong (the first error written wins)."""
    replies, written_ns = {}, {}
    for rank in range(job.world_size):
        path = run / "shared" / f"rank{rank}.result"
        if path.exists():
            replies[rank] = read_reply(path)
            written_ns[rank] = path.stat().st_mtime_ns
    setup_failed = sorted((r for r in replies if replies[r].get("kind") == GROUP_SETUP), key=written_ns.get)
    if setup_failed:  # before any student code ran: whatever the other ranks did follows from it
        reply = replies[setup_failed[0]]
        raise GroupSetupFailed(f"rank {setup_failed[0]} of {job.world_size} could not join the process group: "
                               f"{inert(reply['message'])}")
    missing = [r for r in range(job.world_size) if r not in replies]
    # A rank that exited by itself without a result is the cause of whatever its peers then saw.
    for rank in missing:
        if exit_codes.get(rank) is not None:
            raise StudentCrashed(rank_death(run, rank, job.world_size, exit_codes[rank]))
    # The first error written is the cause; later ones are usually peers failing in a collective it left.
    for rank in sorted(replies, key=written_ns.get):
        reply = replies[rank]
        if reply["status"] == "error":
            if reply["kind"] == "not_implemented":
                raise NotImplementedByStudent("not implemented")
            # A collective that fails because a peer left (connection reset, timeout) is explained by who got where.
            progress = {last_progress(run, r)[0] for r in range(job.world_size)}
            finished = {r for r, other in replies.items() if other["status"] == "ok"}
            mismatch = f"\nthe ranks disagree on collectives: {hang_diagnosis(run, job.world_size, finished)}"
            raised = inert(reply["message"])
            raise StudentError(
                f"rank {rank} of {job.world_size} raised {raised}"
                + (mismatch if len(progress) > 1 else "")
                + f"\n{inert(reply['traceback'])}",
                tuple(inert(name) for name in reply["type_names"]),
                raised,
            )
    if timed_out:
        raise StudentTimedOut(
            f"{job.world_size} ranks did not finish within {job.timeout_s:.0f} s: "
            + hang_diagnosis(run, job.world_size, set(replies))
        )
    if missing:
        raise StudentCrashed(rank_death(run, missing[0], job.world_size, None))
    return [replies[r]["value"] for r in range(job.world_size)]


class GroupSetupFailed(StudentAbort):
    """The ranks' process group did not form: the grader's setup failed, before any student code was imported."""

    status = "failed"


def launch(launcher, job: RankJob) -> list:
    """`launcher.run(job)`, launched once more when the process group did not form (gloo's connections can time out
    on a loaded machine); what still fails is the grader's error, reported with gloo's whole message."""
    with _ignoring(GroupSetupFailed):
        return launcher.run(job)
    try:
        return launcher.run(job)
    except GroupSetupFailed as failure:
        raise GroupSetupFailed(f"grader error, not your code's: {failure.message} (launched twice); please report it "
                               "to the course staff") from failure


def log_text(path: Path) -> str:
    """The end of a log written inside the sandbox, escaped (grader.checks.inert) before it is split into lines, so
    that only newlines end a line."""
    try:
        return escaped(read_tail(path))
    except OSError:  # not written, or not a regular file: nothing is read through a link
        return ""


def log_tail(path: Path, lines: int = 15) -> str:
    return inert("\n".join(log_text(path).splitlines()[-lines:]))


def last_words(path: Path, lines: int = 15) -> str:
    """What a dead rank printed last; for a fatal error, the head of Python's dump of its stack, which lists the
    innermost call first (the frames below it are the grader's own start of the rank)."""
    text = log_text(path)
    fatal = text.rfind("Fatal Python error")
    shown = text.splitlines()[-lines:] if fatal < 0 else text[fatal:].splitlines()[:lines]
    return inert("\n".join(shown))


def rank_death(run: Path, rank: int, world_size: int, exit_code: int | None) -> str:
    tail = last_words(run / "shared" / f"rank{rank}.log")
    message = f"rank {rank} of {world_size} died ({exit_description(exit_code)}) without a result" + (
        f"; its last output:\n{tail}" if tail else ""
    )
    launch = log_tail(run / "host.log")  # the sandbox's own complaints, if the launch itself failed
    return message + (f"\nthe launch's output:\n{launch}" if exit_code is None and launch else "")


class LocalLauncher:
    """The ranks as processes on this machine, forked by a group process in its sandbox (grader.ranks.group).

    The group outlives its launch: one is started for each implementation (the student's code and the reference's
    never share one) on its first launch and kept for the next, so a launch costs forks instead of Python's start
    and torch's import in a new sandbox. Between launches the group kills whatever the ranks left running and the
    launch's folder is removed. A launch that times out, or after which the group does not report back, ends the
    group and its sandbox with it, and the next launch starts a fresh one; `close()` ends them all."""

    name = "local"

    def __init__(self):
        self.groups: dict[tuple, RankGroup] = {}

    def run(self, job: RankJob) -> list:
        key = (job.impl, job.resolved_backend(), job.isolation, job.disable_userns, job.extra_code)
        if key not in self.groups or not self.groups[key].alive():
            self.groups[key] = RankGroup(job)
        group = self.groups[key]
        launch = group.new_launch()
        run = prepare_run_dir(job, shared=group.shared / launch)
        (run / "host.log").symlink_to(group.log)  # the sandbox's own complaints, should the group die
        retired = None
        try:
            group.start(launch, job.world_size, rank_data_fds(run, job.world_size))
            timed_out = wait_for_ranks(lambda: not group.alive(), run, job)
            if timed_out or not group.reported_back():
                retired = self.groups.pop(key)
                retired.stop()  # its sandbox, and every rank still in it, ends here
            return collect(run, job, exit_codes_of(run, job.world_size), timed_out)
        finally:
            shutil.rmtree(group.shared / launch, ignore_errors=True)
            shutil.rmtree(run, ignore_errors=True)
            if retired is not None:
                retired.close()

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups.clear()


class RankGroup:
    """A group process serving launches in one sandbox, and the grader's control socket to it."""

    def __init__(self, job: RankJob):
        self.root = Path(tempfile.mkdtemp(prefix=f"rank-group-{job.problem}-"))
        self.shared = self.root / "shared"
        self.shared.mkdir()
        self.log = self.root / "group.log"
        self.launches = 0
        self.isolation, mounts, env = group_sandbox(
            job.isolation, job.resolved_backend() == "nccl", job.disable_userns, job.impl.path, self.shared,
            tuple(Path(p) for p in job.extra_code))
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(self.log, "wb") as log:
            self.process = self.isolation.popen(
                [sys.executable, "-m", "grader.ranks.group", "--serve", str(self.isolation.run_path(self.shared)),
                 str(theirs.fileno())],
                mounts, pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT,
            )
        theirs.close()

    def alive(self) -> bool:
        return self.process.poll() is None

    def new_launch(self) -> str:
        self.launches += 1
        name = f"launch-{self.launches}"
        (self.shared / name).mkdir()
        self.isolation.grant(self.shared / name)
        return name

    def start(self, launch: str, world_size: int, data_fds: list[int]) -> None:
        try:
            socket.send_fds(self.control, [json.dumps({"launch": launch, "world_size": world_size}).encode()], data_fds)
        except OSError:
            pass  # the group is gone: the launch then finds no rank, and says so
        finally:
            for fd in data_fds:
                os.close(fd)

    def reported_back(self) -> bool:
        """Whether the group said it is ready for the next launch (it has reaped the ranks and their leftovers)."""
        self.control.settimeout(GRACE_S)
        try:
            return self.control.recv(16) == b"done"
        except OSError:
            return False

    def stop(self) -> None:
        self.control.close()
        kill_group(self.process)

    def close(self) -> None:
        self.stop()
        self.isolation.close()
        shutil.rmtree(self.root, ignore_errors=True)


def wait_for_ranks(ended, run: Path, job: RankJob) -> bool:
    """Wait for every rank; True if the time ran out. One rank's failure shortens everyone's wait."""
    deadline = time.monotonic() + job.timeout_s
    while time.monotonic() < deadline:
        if ended():
            return False
        codes = exit_codes_of(run, job.world_size)
        if all(code is not None for code in codes.values()):
            return False
        failed = any(code not in (None, 0) for code in codes.values()) or any(
            _is_error(run / "shared" / f"rank{r}.result") for r in range(job.world_size)
        )
        if failed:
            deadline = min(deadline, time.monotonic() + GRACE_S)
        time.sleep(POLL_S)
    return not ended() and not all(code is not None for code in exit_codes_of(run, job.world_size).values())


def _is_error(path: Path) -> bool:
    return path.exists() and read_reply(path)["status"] == "error"


@contextmanager
def _ignoring(*errors):
    try:
        yield
    except errors:
        pass


def launcher_environment() -> dict[str, str]:
    """The host process' environment: the grader's, without its secrets (the host passes it on to the ranks)."""
    return without_secrets(os.environ)


@contextmanager
def _without_secrets():
    """Jobs inherit the environment at submission: keep the grading seed and reference path out of it."""
    saved = {k: os.environ.pop(k) for k in SECRET_VARIABLES if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def run_host(run_dir: str) -> int:
    """Submitit's job function: the host process, started as a command so that it runs with a clean interpreter."""
    return subprocess.run(host_command(Path(run_dir)), stdin=subprocess.DEVNULL, env=launcher_environment()).returncode


class SubmititLauncher:
    """One submitit job that runs the launch's host process: `executor="local"` here, `"slurm"` on a cluster."""

    name = "submitit"

    def __init__(self, executor: str = "local", folder: Path | None = None, **parameters):
        self.executor = executor
        self.folder = folder
        self.parameters = parameters

    def run(self, job: RankJob) -> list:
        import submitit

        run = prepare_run_dir(job)
        # A fresh folder per run: submitit folders reused across runs can return stale results when job ids repeat.
        folder = (self.folder or run) / f"submitit-{run.name}"
        executor = submitit.AutoExecutor(folder=folder, cluster=self.executor)
        executor.update_parameters(
            nodes=1, tasks_per_node=1, cpus_per_task=job.world_size,
            timeout_min=max(1, math.ceil(job.timeout_s / 60)), **self.parameters,
        )
        try:
            with _without_secrets():
                submitted = executor.submit(run_host, str(run))
            timed_out = wait_for_ranks(submitted.done, run, job)
            if timed_out:
                submitted.cancel(check=False)
            return collect(run, job, exit_codes_of(run, job.world_size), timed_out)
        finally:
            shutil.rmtree(run, ignore_errors=True)


class SrunLauncher:
    """Inside a Slurm allocation: the launch is one job step (`srun --ntasks=1`) whose one task is the host process,
    which starts every rank in one sandbox. The allocation must hold a CPU per rank on one node."""

    name = "srun"

    def run(self, job: RankJob) -> list:
        run = prepare_run_dir(job)
        command = [
            "srun", "--ntasks=1", f"--cpus-per-task={job.world_size}", "--nodes=1", "--overlap",
            f"--job-name=ranks-{job.problem}", "--output", str(run / "host.log"), *host_command(run),
        ]
        step = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=launcher_environment(), start_new_session=True)
        try:
            timed_out = wait_for_ranks(lambda: step.poll() is not None, run, job)
            return collect(run, job, exit_codes_of(run, job.world_size), timed_out)
        finally:
            with _ignoring(ProcessLookupError):
                os.killpg(step.pid, signal.SIGKILL)  # srun forwards the kill to the step's task
            step.wait()
            shutil.rmtree(run, ignore_errors=True)


def launcher_for(name: str) -> LocalLauncher | SubmititLauncher | SrunLauncher:
    if name == "local":
        return LocalLauncher()
    if name == "submitit":
        return SubmititLauncher("local")
    if name == "srun":
        return SrunLauncher()
    raise ValueError(f"unknown launcher {name!r}: choose local, submitit or srun")
