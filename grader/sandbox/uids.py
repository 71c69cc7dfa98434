"""A uid of its own for every sandbox a root grader starts.

Started by root, a sandbox whose user namespace maps its user to the grader's would be root outside: it could read
whatever root can read and is mounted, and the kernel does not enforce the process limit for root. So a root grader
runs student code as a uid from a range no account uses, one per sandbox: nothing it runs is root outside, and the
per-user process limit (RLIMIT_NPROC, counted per uid) holds for each sandbox apart. A slot of the range is held by an
exclusive lock on its file for as long as its sandbox may run, so concurrent graders on one machine (the lanes of
`--jobs`, grade-all's jobs on one node) never share a uid; the kernel drops the lock when its holder dies.
"""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
from pathlib import Path

FIRST_UID = 1_900_000_000  # far above the uids of accounts (below 60000 on common systems) and of subuid ranges
SLOTS = 65_536


def lock_folder() -> Path:
    """A folder only root can write (a student's uid must not hold slots), in /run where the machine has it."""
    base = Path("/run") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir())
    folder = base / "gpu-systems-grader-sandbox-uids"
    folder.mkdir(mode=0o700, exist_ok=True)
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise RuntimeError(f"{folder} must be a folder that only root can write")
    return folder


class SandboxUid:
    """One uid, held until release()."""

    def __init__(self):
        folder = lock_folder()
        for slot in range(SLOTS):
            fd = os.open(folder / str(slot), os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid = FIRST_UID + slot
            self._lock_fd: int | None = fd
            return
        raise RuntimeError(f"all {SLOTS} sandbox uids are in use")

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
