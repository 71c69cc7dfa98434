"""Skip conditions and marks shared by the problems' test modules."""

import ast
from pathlib import Path

import pytest
import torch

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
bf16_gpu_only = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="bf16 is graded on a GPU only: Triton's interpreter computes bf16 arithmetic wrongly",
)


def multi_gpu(count: int):
    """Skip unless this machine has at least `count` GPUs (one per rank)."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(available < count, reason=f"needs {count} GPUs, one per rank ({available} here)")


# A test that times the student's kernels on a GPU when there is one, like the speed tests: in the students' copy,
# which grades on the CPU with the GPUs hidden, it runs with them in the GPU lane (grader.plugin.pytest_runtestloop).
timed_on_gpu = pytest.mark.timed_on_gpu


def dtypes_drawn_on_gpu_only(test_module: Path) -> tuple[str, ...]:
    """The dtypes a problem's test module draws only where a GPU is present, read from its source: the torch dtypes
    named in `A if torch.cuda.is_available() else B` and not in B (bfloat16, whose arithmetic Triton's interpreter
    gets wrong). Tests skipped without a GPU say so themselves; these dtypes are left out of tests that do run."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(test_module.read_text())):
        if isinstance(node, ast.IfExp) and ast.unparse(node.test) == "torch.cuda.is_available()":
            found |= torch_dtypes(node.body) - torch_dtypes(node.orelse)
    return tuple(sorted(found))


def torch_dtypes(node: ast.AST) -> set[str]:
    """The names of the torch dtypes an expression names (torch.bfloat16, ...)."""
    return {part.attr for part in ast.walk(node) if isinstance(part, ast.Attribute)
            and ast.unparse(part.value) == "torch" and isinstance(getattr(torch, part.attr, None), torch.dtype)}
