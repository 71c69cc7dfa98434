"""The first process of a launch inside the sandbox: `python -m grader.distributed.group RUN_DIR WORLD_SIZE`.

Grader code, run before any student code. It imports torch, the rank's entry point and the grader's program once, then forks one process per
rank: a rank started as its own interpreter would pay Python's start and torch's import itself (about 1.5 s of CPU
each, more where torch loads its CUDA libraries), and the ranks of a launch start together, so on a machine with
fewer cores than ranks that cost is paid in series. Nothing of torch runs before the fork (no thread pool, no CUDA
context), so each rank starts as clean as a fresh interpreter. Each rank holds only its own inputs' descriptor; the
group records each rank's exit status in `rank<r>.exit` and returns when every rank has ended.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path


def start_rank(entry, run: Path, rank: int, world_size: int, data_fds: list[int]) -> int:
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
        for other, fd in enumerate(data_fds):
            if other != rank:
                os.close(fd)  # from here on, only rank r holds rank r's inputs
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


def main() -> int:
    run, world_size = Path(sys.argv[1]), int(sys.argv[2])
    data_fds = [int(fd) for fd in os.environ.pop("GRADER_RANK_DATA_FDS", "").split(",") if fd]
    sys.path.insert(0, str(Path.cwd()))
    # Once, before the forks: torch, the rank's entry point and the module of the grader's program.
    from grader.distributed import rank as entry
    from grader.sandbox.wire import decode

    importlib.import_module(decode((run / "job.pt").read_bytes())["program"].partition(":")[0])

    rank_of = {start_rank(entry, run, rank, world_size, data_fds): rank for rank in range(world_size)}
    for fd in data_fds:
        os.close(fd)
    while rank_of:  # in the order they end: a rank that died early is known while its peers still wait
        pid, status = os.wait()
        if pid in rank_of:
            temporary = run / f"rank{rank_of[pid]}.exit.partial"
            temporary.write_text(str(os.waitstatus_to_exitcode(status)))
            temporary.rename(run / f"rank{rank_of.pop(pid)}.exit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
