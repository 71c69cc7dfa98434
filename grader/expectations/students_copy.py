"""Where the students' copy keeps its stored expectations, and what having them means for the GPU."""

from __future__ import annotations

import os
from pathlib import Path

RELEASE_FOLDER = Path(__file__).resolve().parents[2] / "expectations"


def students_copy_folder() -> Path | None:
    """The students' copy's stored expectations (written by `python -m grader release`), if this is one."""
    return RELEASE_FOLDER if RELEASE_FOLDER.is_dir() else None


def hide_gpus_in_students_copy() -> None:
    """The students' copy's expectations are what the CPU draws (a GPU draws other sizes): it grades on the CPU, and
    leaves speed and GPU tests to the graded submission. Called before torch first looks for a GPU."""
    if students_copy_folder() is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
