"""A control group for each sandbox, where this machine lets the grader make one.

The kernel then holds all of a sandbox's processes and threads (pids) and its memory to the sandbox's own limits,
whatever uid they run as and however many processes share the memory: one sandbox cannot starve another, nor the
grader. Two layouts are used: cgroup v1 with writable `pids` and `memory` hierarchies (containers without systemd),
or a cgroup v2 folder of the grader's own whose subtree has both controllers (a delegated slice, or the root). Where
neither is offered (a non-root grader, most often) the per-process limits of grader.sandbox.isolation remain.
"""

from __future__ import annotations

import functools
import os
import secrets
import signal
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def own_cgroup(controller: str | None) -> str:
    """This process's cgroup path in the v1 hierarchy of `controller`, or in the v2 hierarchy (None)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (controller is None and controllers == "") or (controller in controllers.split(",")):
            return path.lstrip("/")
    raise LookupError(controller)


@functools.cache
def parents() -> dict[str, Path] | None:
    """Where a sandbox's group is made, by controller ("pids", "memory"; "unified" for v2), or None if nowhere."""
    if os.geteuid() != 0:
        return None
    try:
        v1 = {c: CGROUP_ROOT / c / own_cgroup(c) for c in ("pids", "memory")}
        if all((path / "cgroup.procs").exists() and os.access(path, os.W_OK) for path in v1.values()):
            return v1
    except (LookupError, OSError):
        pass
    try:
        unified = CGROUP_ROOT / own_cgroup(None)
        delegated = set((unified / "cgroup.subtree_control").read_text().split())
    except (LookupError, OSError):
        return None
    return {"unified": unified} if {"pids", "memory"} <= delegated and os.access(unified, os.W_OK) else None


class ControlGroup:
    """One sandbox's group: at most `max_tasks` processes and threads, `max_memory_bytes` of memory."""

    def __init__(self, max_tasks: int, max_memory_bytes: int):
        self.folders = []
        # A random name: a process id is reused, and a grader killed before close() leaves its groups behind.
        name = f"gpu-systems-sandbox-{os.getpid()}-{secrets.token_hex(6)}"
        for controller, parent in (parents() or {}).items():
            folder = parent / name
            folder.mkdir()
            self.folders.append(folder)
            if controller == "pids":
                (folder / "pids.max").write_text(str(max_tasks))
            elif controller == "memory":
                (folder / "memory.limit_in_bytes").write_text(str(max_memory_bytes))
            else:
                (folder / "pids.max").write_text(str(max_tasks))
                (folder / "memory.max").write_text(str(max_memory_bytes))
                if (folder / "memory.swap.max").exists():
                    (folder / "memory.swap.max").write_text("0")  # a limit swap could step around is none

    def join(self) -> None:
        """Move the calling process into the group: run in the child before exec, so all it starts is inside."""
        for folder in self.folders:
            (folder / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        """Kill what is left in the group, then remove it (a group with tasks cannot be removed)."""
        deadline = time.monotonic() + 5
        for folder in reversed(self.folders):
            while folder.exists():
                try:
                    folder.rmdir()
                except OSError:
                    for pid in (folder / "cgroup.procs").read_text().split():
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
        self.folders = []
