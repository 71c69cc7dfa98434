"""Hostile: tries to use the reference solution, by import and then by reading its file where it lies on the grading
machine (HOSTILE_REFERENCE_GUESS: a student may know the layout; inside the sandbox it is not there at all)."""

import os
from pathlib import Path

try:
    from reference.kernels.softmax import softmax  # importing it is the attack
except ImportError as import_error:
    source = Path(os.environ.get("HOSTILE_REFERENCE_GUESS", "/reference")) / "kernels" / "softmax.py"
    try:
        namespace = {}
        exec(compile(source.read_text(), str(source), "exec"), namespace)
        softmax = namespace["softmax"]
    except OSError as read_error:
        blocked = f"import refused ({import_error}); read refused ({read_error})"

        def softmax(x):
            raise RuntimeError(f"could not use the reference: {blocked}")
