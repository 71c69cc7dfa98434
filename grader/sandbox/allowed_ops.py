"""What torch may do inside a Triton problem's call: allocate, view, copy and describe tensors, never compute.

A kernel problem is to compute its answer in the student's Triton kernels. A denylist of the operator the problem
reimplements leaves every other route open (log_softmax then exp, cumsum, a broadcast multiply and sum, numpy), so
the rule is an allowlist: while a Triton problem's function (and its backward) runs, each aten operator must be one
of ALLOWED_OPS, or be called by Triton's own code (the interpreter copies tensors to and from the host; an autotuner
times its configurations). Reading a tensor's values into Python or numpy (`.numpy()`, `.tolist()`, `.item()`) is
refused the same way. The allowlist is held twice in the worker: by the Python-level operator recorder
(grader.sandbox.guards), and at torch's dispatcher (grader.sandbox.dispatch_gate), which switching Python dispatch off
does not reach.
"""

from __future__ import annotations

import sys
from pathlib import Path

ALLOWED_OPS = frozenset({
    # allocation, and filling with one value
    "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
    "aten.zeros", "aten.zeros_like", "aten.new_zeros", "aten.ones", "aten.ones_like", "aten.new_ones",
    "aten.full", "aten.full_like", "aten.new_full", "aten.zero_", "aten.fill_", "aten.resize_",
    "aten.scalar_tensor", "aten.lift_fresh", "aten.lift_fresh_copy",
    # views and layout
    "aten.view", "aten._unsafe_view", "aten._reshape_alias", "aten.reshape", "aten.as_strided", "aten.alias",
    "aten.detach", "aten.transpose", "aten.t", "aten.permute", "aten.expand", "aten.unsqueeze", "aten.squeeze",
    "aten.slice", "aten.select", "aten.split", "aten.split_with_sizes", "aten.unbind", "aten.narrow",
    "aten.flatten", "aten.unflatten", "aten.movedim", "aten.view_as",
    # copies and casts (moving values, not computing new ones)
    "aten.clone", "aten.copy_", "aten._to_copy", "aten.contiguous", "aten.set_",
    # metadata
    "aten.sym_size", "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset", "aten.is_contiguous",
})

def _dirs(file: str) -> tuple[str, ...]:
    """A package's folder as its frames name it, and resolved (the two differ where site-packages is a link)."""
    return tuple({str(Path(file).parent) + "/", str(Path(file).resolve().parent) + "/"})


# Frames that are neither the student's nor Triton's: torch's own Python code, and the grader's recorders.
SKIPPED_DIRS = _dirs(__import__("torch").__file__) + _dirs(__file__)


def _package_dirs(name: str) -> tuple[str, ...]:
    module = sys.modules.get(name)
    return _dirs(module.__file__) if module is not None and module.__file__ else ()


def called_by_triton() -> bool:
    """Whether the innermost caller outside torch and the grader's sandbox code is Triton's own code."""
    triton_dirs = _package_dirs("triton")
    frame = sys._getframe(1)
    while frame is not None and triton_dirs:
        filename = frame.f_code.co_filename
        if not filename.startswith(SKIPPED_DIRS):
            return filename.startswith(triton_dirs)
        frame = frame.f_back
    return False
