"""The reference cannot change under the grader: its modules are imported before any student code runs, their files
hashed, and the hashes checked again before results are written. A change aborts the grading run."""

from __future__ import annotations

import hashlib
from pathlib import Path


def fingerprint(directory: Path) -> dict[str, str]:
    """SHA-256 of every file below the reference package (caches excluded), by relative path."""
    digests = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            digests[str(path.relative_to(directory))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
