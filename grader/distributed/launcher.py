"""Launchers run one program on `world_size` ranks and bring back each rank's result.

All launchers share one protocol through a run directory: the job description in `job.pt`, and from each rank a
progress file (one line per collective it entered) and a result file (a torch.save of plain data, loaded with
weights_only=True). So the verdict never depends on unpickling what student processes wrote, and a hang can be
explained from the progress files whichever launcher ran the ranks.

- `LocalLauncher`: one process per rank on this machine (gloo on CPU; NCCL when every rank has a GPU).
- `SubmititLauncher`: one job with a task per rank through submitit (its local executor, or Slurm).
- `SrunLauncher`: inside a Slurm allocation, one job step whose tasks are the ranks.
"""

from __future__ import annotations

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

from grader.outcomes import NotImplementedByStudent, StudentCrashed, StudentError, StudentTimedOut
from grader.packages import PackageSpec
from grader.sandbox.client import SECRET_VARIABLES, exit_description, student_environment
from grader.sandbox.wire import decode, encode

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
    timeout_s: float = 60.0
    collective_timeout_s: float = 90.0
    backend: str = "auto"

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= self.world_size else "gloo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_run_dir(job: RankJob, master_addr: str) -> Path:
    run = Path(tempfile.mkdtemp(prefix=f"ranks-{job.problem}-"))
    description = {
        "problem": job.problem,
        "impl": job.impl.to_json(),
        "reference": job.reference.to_json(),
        "program": job.program,
        "args": list(job.args),
        "kwargs": job.kwargs,
        "backend": job.resolved_backend(),
        "master_addr": master_addr,
        "master_port": free_port(),
        "collective_timeout_s": job.collective_timeout_s,
    }
    (run / "job.pt").write_bytes(encode(description))
    return run


def last_progress(run: Path, rank: int) -> tuple[int, str]:
    """(sequence number, operation) of the last collective the rank entered; (0, "") if none."""
    try:
        lines = (run / f"rank{rank}.progress").read_text().splitlines()
    except OSError:
        return 0, ""
    seq, _, op = lines[-1].partition(" ") if lines else ("0", "", "")
    return int(seq), op


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


def collect(run: Path, job: RankJob, exit_codes: dict[int, int | None], timed_out: bool) -> list:
    """Each rank's value, or the exception that describes what went wrong (the first error written wins)."""
    replies, written_ns = {}, {}
    for rank in range(job.world_size):
        path = run / f"rank{rank}.result"
        if path.exists():
            replies[rank] = decode(path.read_bytes())
            written_ns[rank] = path.stat().st_mtime_ns
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
            raise StudentError(
                f"rank {rank} of {job.world_size} raised {reply['message']}"
                + (mismatch if len(progress) > 1 else "")
                + f"\n{reply['traceback']}",
                tuple(reply["type_names"]),
                reply["message"],
            )
    if timed_out:
        raise StudentTimedOut(
            f"{job.world_size} ranks did not finish within {job.timeout_s:.0f} s: "
            + hang_diagnosis(run, job.world_size, set(replies))
        )
    if missing:
        raise StudentCrashed(rank_death(run, missing[0], job.world_size, None))
    return [replies[r]["value"] for r in range(job.world_size)]


def rank_death(run: Path, rank: int, world_size: int, exit_code: int | None) -> str:
    log = run / f"rank{rank}.log"
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log.exists() else ""
    return f"rank {rank} of {world_size} died ({exit_description(exit_code)}) without a result" + (
        f"; its last output:\n{tail}" if tail else ""
    )


class LocalLauncher:
    """One process per rank on this machine."""

    name = "local"

    def run(self, job: RankJob) -> list:
        run = prepare_run_dir(job, "127.0.0.1")
        processes = {}
        try:
            for rank in range(job.world_size):
                env = student_environment()
                env.update(RANK=str(rank), WORLD_SIZE=str(job.world_size), LOCAL_RANK=str(rank))
                with open(run / f"rank{rank}.log", "wb") as log:
                    processes[rank] = subprocess.Popen(
                        [sys.executable, "-m", "grader.distributed.rank", str(run)],
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
            timed_out = self.wait(processes, run, job)
            return collect(run, job, {r: p.poll() for r, p in processes.items()}, timed_out)
        finally:
            for process in processes.values():
                with _ignoring(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            shutil.rmtree(run, ignore_errors=True)

    @staticmethod
    def wait(processes: dict[int, subprocess.Popen], run: Path, job: RankJob) -> bool:
        """Wait for every rank; True if the time ran out. One rank's failure shortens everyone's wait."""
        deadline = time.monotonic() + job.timeout_s
        while time.monotonic() < deadline:
            codes = {r: p.poll() for r, p in processes.items()}
            if all(code is not None for code in codes.values()):
                return False
            failed = any(code not in (None, 0) for code in codes.values()) or any(
                _is_error(run / f"rank{r}.result") for r in processes
            )
            if failed:
                deadline = min(deadline, time.monotonic() + GRACE_S)
            time.sleep(POLL_S)
        return not all(p.poll() is not None for p in processes.values())


def _is_error(path: Path) -> bool:
    return path.exists() and decode(path.read_bytes())["status"] == "error"


@contextmanager
def _ignoring(*errors):
    try:
        yield
    except errors:
        pass


@contextmanager
def _without_secrets():
    """Jobs inherit the environment at submission: keep the grading seed and reference path out of it."""
    saved = {k: os.environ.pop(k) for k in SECRET_VARIABLES if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


class SubmititLauncher:
    """One submitit job whose tasks are the ranks: `executor="local"` here, `"slurm"` on a cluster."""

    name = "submitit"

    def __init__(self, executor: str = "local", folder: Path | None = None, **parameters):
        self.executor = executor
        self.folder = folder
        self.parameters = parameters

    def run(self, job: RankJob) -> list:
        import submitit

        from grader.distributed.rank import run_rank

        master_addr = "127.0.0.1" if self.executor == "local" else socket.gethostname()
        run = prepare_run_dir(job, master_addr)
        # A fresh folder per run: submitit folders reused across runs can return stale results when job ids repeat.
        folder = (self.folder or run) / f"submitit-{run.name}"
        executor = submitit.AutoExecutor(folder=folder, cluster=self.executor)
        executor.update_parameters(
            nodes=1, tasks_per_node=job.world_size, timeout_min=max(1, math.ceil(job.timeout_s / 60)), **self.parameters
        )
        try:
            with _without_secrets():
                submitted = executor.submit(run_rank, str(run))
            deadline = time.monotonic() + job.timeout_s
            while not submitted.done() and time.monotonic() < deadline:
                time.sleep(POLL_S * 4)
            timed_out = not submitted.done()
            if timed_out:
                submitted.cancel(check=False)
            return collect(run, job, {}, timed_out)
        finally:
            shutil.rmtree(run, ignore_errors=True)


class SrunLauncher:
    """Inside a Slurm allocation: the ranks are the tasks of one job step (`srun --ntasks=N`), reading SLURM_PROCID,
    SLURM_NTASKS and SLURM_LOCALID. The allocation must hold at least N tasks on one node."""

    name = "srun"

    def run(self, job: RankJob) -> list:
        run = prepare_run_dir(job, socket.gethostname())
        env = student_environment()
        for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(variable, None)
        command = [
            "srun", f"--ntasks={job.world_size}", "--nodes=1", "--overlap", "--kill-on-bad-exit=0",
            f"--job-name=ranks-{job.problem}", "--output", str(run / "rank%t.log"),
            sys.executable, "-m", "grader.distributed.rank", str(run),
        ]  # fmt: skip
        step = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            try:
                step.wait(timeout=job.timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            return collect(run, job, {}, timed_out)
        finally:
            with _ignoring(ProcessLookupError):
                os.killpg(step.pid, signal.SIGKILL)  # srun forwards the kill to every task of the step
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
