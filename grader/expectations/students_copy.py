"""Where the students' copy keeps its stored expectations, and what having them means for the GPU.

The expectations are what the CPU draws (a GPU draws other sizes), so the copy's `pytest grader` grades on the CPU
with the GPUs hidden. Its speed tests need the GPU and no stored draws: they run afterwards in one more pytest
process, the GPU lane, which sees the GPUs that were hidden (GPU_LANE_VARIABLE set in its environment)."""

from __future__ import annotations

import os
from pathlib import Path

RELEASE_FOLDER = Path(__file__).resolve().parents[2] / "expectations"
GPU_LANE_VARIABLE = "GRADER_GPU_LANE"
_NOT_SET = object()
_hidden: object = _NOT_SET  # CUDA_VISIBLE_DEVICES before the copy hid the GPUs (None: it was not set)


def students_copy_folder() -> Path | None:
    """The students' copy's stored expectations (written by `python -m grader release`), if this is one."""
    return RELEASE_FOLDER if RELEASE_FOLDER.is_dir() else None


def in_gpu_lane() -> bool:
    return os.environ.get(GPU_LANE_VARIABLE) == "1"


def hide_gpus_in_students_copy() -> None:
    """In the students' copy (but not in its GPU lane), hide the GPUs from this process and every process it starts.
    Called before torch first looks for a GPU."""
    global _hidden
    if students_copy_folder() is None or in_gpu_lane():
        return
    if _hidden is _NOT_SET:
        _hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def hidden_gpus_present() -> bool:
    """Whether this machine has NVIDIA GPUs that hide_gpus_in_students_copy hid (seen without initialising CUDA,
    which would fix this process's view of the devices)."""
    return _hidden is not _NOT_SET and _hidden != "" and any(Path("/dev").glob("nvidia[0-9]*"))


def gpu_lane_environment() -> dict[str, str]:
    """The GPU lane's environment: this process's, with the hidden GPUs visible again."""
    environment = {**os.environ, GPU_LANE_VARIABLE: "1"}
    if _hidden is None or _hidden is _NOT_SET:
        environment.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        environment["CUDA_VISIBLE_DEVICES"] = str(_hidden)
    return environment
