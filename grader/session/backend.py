"""Where kernels run: on a GPU when there is one, else through Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os
import re
import sys
from importlib import metadata

import torch

# The oldest Triton whose interpreter (the CPU path) grades correct code correctly. triton 3.6's interpreter, which
# pyproject.toml still allows for GPUs, fails correct kernels: a scalar loop's load raises "only 0-dimensional arrays
# can be converted to Python scalars", and correct row-sum, RMSNorm and matmul variants lose most of their points.
MIN_INTERPRETER_TRITON = (3, 9)


def use_interpreter_without_gpu() -> None:
    """Set TRITON_INTERPRET=1 when there is no GPU. The variable is read once, when triton is first imported."""
    if torch.cuda.is_available() or interpreting():
        return
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before the grader could select its interpreter (no GPU here)")
    os.environ["TRITON_INTERPRET"] = "1"


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def interpreting() -> bool:
    """Whether Triton runs (or will run, once imported) its interpreter: TRITON_INTERPRET read as Triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def release(version: str) -> tuple[int, ...]:
    """(3, 9) for "3.9.0", "3.9.0+git1234" or "3.9.0rc1": the major and minor numbers."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def interpreter_refusal(installed: str | None = None) -> str | None:
    """Why this machine cannot grade on the CPU path, or None: on the interpreter, triton must be at least
    MIN_INTERPRETER_TRITON (a GPU runs compiled kernels, where older versions are fine)."""
    if not interpreting():
        return None
    installed = installed or metadata.version("triton")
    if release(installed) >= MIN_INTERPRETER_TRITON:
        return None
    needed = ".".join(map(str, MIN_INTERPRETER_TRITON))
    return (f"triton {installed} is installed, and grading without a GPU runs kernels through Triton's interpreter, "
            f"which needs triton >= {needed} (older interpreters fail correct kernels): "
            f"pip install 'triton>={needed}', or grade on a GPU")
