"""Where kernels run: on a GPU when there is one, else through Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os
import sys

import torch


def use_interpreter_without_gpu() -> None:
    """Set TRITON_INTERPRET=1 when there is no GPU. The variable is read once, when triton is first imported."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before the grader could select its interpreter (no GPU here)")
    os.environ["TRITON_INTERPRET"] = "1"


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
