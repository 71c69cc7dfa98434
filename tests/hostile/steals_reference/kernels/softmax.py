"""Hostile: tries to use the reference solution, by import and then by reading its file."""

from pathlib import Path

try:
    from reference.kernels.softmax import softmax  # noqa: F401
except ImportError as import_error:
    source = Path(__file__).resolve().parents[4] / "reference" / "kernels" / "softmax.py"
    try:
        namespace = {}
        exec(compile(source.read_text(), str(source), "exec"), namespace)
        softmax = namespace["softmax"]
    except PermissionError as read_error:
        blocked = f"import refused ({import_error}); read refused ({read_error})"

        def softmax(x):
            raise RuntimeError(f"could not use the reference: {blocked}")
