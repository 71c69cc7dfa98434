"""Frozen copies of submissions. What a copy holds and what it refuses are grader.sandbox.submission's, the only code
that reads a submission; the students' copy leaves out the same names."""

from __future__ import annotations

import shutil
from pathlib import Path

from grader.sandbox.submission import IGNORED, BadSubmission, read

__all__ = ["IGNORED", "BadSubmission", "snapshot"]


def snapshot(source: Path, destination: Path) -> Path:
    """Copy a submission so that edits made after submitting cannot leak into its grading. Raises BadSubmission,
    before anything is copied, for a submission the grader won't read."""
    tree = read(source)
    if destination.exists():
        shutil.rmtree(destination)
    return tree.write_to(destination)
