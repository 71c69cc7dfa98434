"""The trusted start of one launch of ranks: `python -m grader.ranks.host RUN_DIR`.

Runs outside the sandbox, before any student code, and imports no torch (a launch pays for that in its ranks only).
It opens each rank's own inputs (`private/rank<r>.data.pt`) and removes the files, so that they exist only as open
descriptors, then starts the rank group inside the sandbox with those descriptors; the group hands descriptor r to
rank r alone. The sandbox sees only `shared/`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from grader.sandbox.isolation import Isolation, Mounts, physical_memory


def rank_data_fds(run: Path, world_size: int) -> list[int]:
    """Each rank's own inputs, opened and then removed, so that they exist only as the descriptors handed on."""
    fds = []
    for rank in range(world_size):
        path = run / "private" / f"rank{rank}.data.pt"
        if path.exists():
            fds.append(os.open(path, os.O_RDONLY))
            path.unlink()
    return fds


def group_sandbox(level: str, gpu: bool, disable_userns: bool, impl: Path, shared: Path,
                  extra_code: tuple[Path, ...]) -> tuple[Isolation, Mounts, dict[str, str]]:
    """The sandbox a rank group runs in, what it mounts (the package, `shared` writable) and the group's environment."""
    # CUDA reserves far more address space than it uses: on a GPU the job's own memory limit applies instead.
    isolation = Isolation(level, gpu=gpu, address_space_bytes=None if gpu else physical_memory(),
                          disable_userns=disable_userns)
    isolation.grant(shared)
    mounts = Mounts(impl_dir=impl, run_dir=shared, extra_code=extra_code)
    return isolation, mounts, {"GRADER_IMPL_DIR": str(isolation.impl_path(impl))}


def main() -> int:
    run = Path(sys.argv[1])
    host = json.loads((run / "private" / "host.json").read_text())
    shared = run / "shared"
    isolation, mounts, env = group_sandbox(host["isolation"], host["gpu"], host["disable_userns"],
                                           Path(host["impl"]["path"]), shared,
                                           tuple(Path(p) for p in host["extra_code"]))
    data_fds = rank_data_fds(run, host["world_size"])
    env["GRADER_RANK_DATA_FDS"] = ",".join(map(str, data_fds))
    group = isolation.popen(
        [sys.executable, "-m", "grader.ranks.group", str(isolation.run_path(shared)), str(host["world_size"])],
        mounts, pass_fds=tuple(data_fds), env=env, stdin=subprocess.DEVNULL,
    )
    for fd in data_fds:
        os.close(fd)
    try:
        return group.wait()
    finally:
        isolation.close()


if __name__ == "__main__":
    sys.exit(main())
