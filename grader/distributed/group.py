"""The first process of a launch inside the sandbox: `python -m grader.distributed.group RUN_DIR WORLD_SIZE`.

Grader code, run before any student code; it imports no torch. Starts one process per rank, each holding only its own
inputs' descriptor, records each rank's exit status in `rank<r>.exit`, and returns when every rank has ended.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def main() -> int:
    run, world_size = Path(sys.argv[1]), int(sys.argv[2])
    fds = [int(fd) for fd in os.environ.pop("GRADER_RANK_DATA_FDS", "").split(",") if fd]
    ranks = []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)}
        own = (fds[rank],) if fds else ()
        if own:
            env["GRADER_RANK_DATA_FD"] = str(own[0])
        with open(run / f"rank{rank}.log", "wb") as log:
            ranks.append(subprocess.Popen([sys.executable, "-m", "grader.distributed.rank", str(run)], pass_fds=own,
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env))
    for fd in fds:
        os.close(fd)  # from here on, only rank r holds rank r's inputs
    rank_of = {process.pid: rank for rank, process in enumerate(ranks)}
    while rank_of:  # in the order they end: a rank that died early is known while its peers still wait
        pid, status = os.wait()
        if pid in rank_of:
            temporary = run / f"rank{rank_of[pid]}.exit.partial"
            temporary.write_text(str(os.waitstatus_to_exitcode(status)))
            temporary.rename(run / f"rank{rank_of.pop(pid)}.exit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
