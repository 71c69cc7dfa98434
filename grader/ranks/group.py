"""The first process of launches inside the sandbox: it imports torch once and forks the ranks of each launch.

Grader code, run before any student code. A rank started as its own interpreter would pay Python's start and torch's
import itself (about 1.5 s of CPU each, more where torch loads its CUDA libraries); forked from this process it starts
in milliseconds. Nothing of torch runs here (no thread pool, no CUDA context), so each rank starts as clean as a fresh
interpreter. Each rank holds only its own inputs' descriptor; the group records each rank's exit status in
`rank<r>.exit` of the launch's folder.

Two ways to run it:

- `python -m grader.ranks.group RUN_DIR WORLD_SIZE`: one launch, the ranks' inputs on the descriptors listed in
  GRADER_RANK_DATA_FDS (started by `grader.ranks.host`, for Slurm and submitit launches).
- `python -m grader.ranks.group --serve ROOT CONTROL_FD`: many launches, one after another, each requested by
  the grader on the control socket (a launch folder below ROOT and its world size, with the ranks' inputs as passed
  descriptors) and answered "done" once every rank has ended and whatever they left running has been killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

from grader.sandbox.wire import decode

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
MAX_LEFTOVER_ROUNDS = 50


def start_rank(entry, run: Path, rank: int, world_size: int, data_fds: list[int], close_fds: tuple[int, ...]) -> int:
    """Fork rank `rank`, its output going to `rank<r>.log`; return its pid."""
    log = os.open(run / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(log)
        return pid
    status = 1
    try:
        for fd in (*close_fds, *(fd for other, fd in enumerate(data_fds) if other != rank)):
            os.close(fd)  # from here on, only rank r holds rank r's inputs, and no rank the group's control socket
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
        if data_fds:
            os.environ["GRADER_RANK_DATA_FD"] = str(data_fds[rank])
        entry.main(str(run))  # ends the process itself
    finally:
        os._exit(status)  # only reached if the rank's entry point itself failed


@contextlib.contextmanager
def launch_store(variable: str):
    """Where the launch's c10d store lives, in the environment variable `variable` for the ranks forked inside the
    block: a file of a random name in a folder of the sandbox's temporary files that the ranks may create files in
    but not list, so that no rank code finds it by looking (not in the launch's folder, which the ranks list). The
    name is drawn here, straight into the environment, and no variable keeps it (the ranks fork from inside this
    process's frames); the folder goes with the launch."""
    folder = Path(tempfile.mkdtemp(prefix="store-"))
    folder.chmod(0o300)
    os.environ[variable] = str(folder / secrets.token_hex(16))
    try:
        yield
    finally:
        del os.environ[variable]
        with contextlib.suppress(OSError):  # gone already, if rank code removed it once empty
            folder.chmod(0o700)
        shutil.rmtree(folder, ignore_errors=True)


def run_launch(entry, run: Path, world_size: int, data_fds: list[int], close_fds: tuple[int, ...] = ()) -> None:
    """Fork the launch's ranks and wait for them, writing each one's exit status as it ends."""
    # The grader's program is imported before the forks too (once per module: later launches find it imported).
    importlib.import_module(decode((run / "job.pt").read_bytes())["program"].partition(":")[0])
    with launch_store(entry.STORE_PATH_VARIABLE):
        rank_of = {start_rank(entry, run, rank, world_size, data_fds, close_fds): rank for rank in range(world_size)}
        for fd in data_fds:
            os.close(fd)
        wait_for_ranks(run, rank_of)


def wait_for_ranks(run: Path, rank_of: dict[int, int]) -> None:
    """Wait for the ranks (pid -> rank), writing each one's exit status as it ends."""
    while rank_of:  # in the order they end: a rank that died early is known while its peers still wait
        pid, status = os.wait()
        if pid in rank_of:
            temporary = run / f"rank{rank_of[pid]}.exit.partial"
            temporary.write_text(str(os.waitstatus_to_exitcode(status)))
            temporary.rename(run / f"rank{rank_of.pop(pid)}.exit")


def parent_of(pid: str) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])  # the fields after the command's name: state, parent, ...


def end_leftovers() -> None:
    """Kill every process the ranks left running. As a subreaper this process inherits their orphans, so each round
    finds its own children, kills them, and takes over theirs in the next."""
    me = os.getpid()
    for _ in range(MAX_LEFTOVER_ROUNDS):
        children = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and parent_of(pid) == me]
        if not children:
            return
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def serve(root: Path, control: socket.socket, entry) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    while True:
        try:
            message, data_fds, _, _ = socket.recv_fds(control, 4096, 64)
        except OSError:
            return
        if not message:
            return  # the grader closed its end: no more launches
        request = json.loads(message)
        run_launch(entry, root / request["launch"], request["world_size"], data_fds, close_fds=(control.fileno(),))
        end_leftovers()
        control.sendall(b"done")


def main() -> int:
    sys.path.insert(0, str(Path.cwd()))
    from grader.ranks import rank as entry  # with torch: once, before any fork

    for module in entry.PRELOADED:
        importlib.import_module(module)

    if sys.argv[1] == "--serve":
        serve(Path(sys.argv[2]), socket.socket(fileno=int(sys.argv[3])), entry)
        return 0
    data_fds = [int(fd) for fd in os.environ.pop("GRADER_RANK_DATA_FDS", "").split(",") if fd]
    run_launch(entry, Path(sys.argv[1]), int(sys.argv[2]), data_fds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
