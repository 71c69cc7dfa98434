"""Frozen copies of submissions, identified by a hash of their content."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

IGNORED_NAMES = ("__pycache__", ".hypothesis", ".pytest_cache", ".git")
IGNORED = shutil.ignore_patterns(*IGNORED_NAMES, "*.pyc")


def copied(relative: Path) -> bool:
    return not any(part in IGNORED_NAMES for part in relative.parts) and relative.suffix != ".pyc"


def tree_hash(directory: Path) -> str:
    """SHA-256 over the relative paths and contents of the files a snapshot would copy."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        relative = path.relative_to(directory)
        if copied(relative):
            digest.update(str(relative).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def snapshot(source: Path, destination: Path) -> Path:
    """Copy a submission so that edits made after submitting cannot leak into its grading."""
    if destination.exists():
        shutil.rmtree(destination)
    shutil.copytree(source, destination, ignore=IGNORED, symlinks=False)
    return destination
