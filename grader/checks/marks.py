"""Skip conditions and marks shared by the problems' test modules."""

from types import ModuleType

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


# The grader's own marks, registered by grader.plugin (and by tests/conftest.py, whose tests import grader modules).
MARKERS = {
    "timed_on_gpu": "times the student's kernels on a GPU (grader.checks.marks)",
    "points_groups": "a test function graded as several points groups (grader.checks.marks.points_groups)",
}

# A test that times the student's kernels on a GPU when there is one, like the speed tests: in the students' copy,
# which grades on the CPU with the GPUs hidden, it runs with them in the GPU lane (grader.plugin.pytest_runtestloop).
timed_on_gpu = pytest.mark.timed_on_gpu


def points_groups(groups: dict[str, list], argname: str):
    """One test function graded as several points groups: it is parametrised by `group`, each value a points group
    of the registry (the score table's rows), and by `argname`, each group's own values (a world size, say). Its
    node ids read test_<function>[<group>-<value>]; group_of reads the group from the parameter."""
    params = [pytest.param(group, value, id=f"{group}-{value}") for group, values in groups.items() for value in values]

    def decorate(function):
        return pytest.mark.points_groups(*groups)(pytest.mark.parametrize(("group", argname), params)(function))

    return decorate


def group_of(item: pytest.Item) -> str:
    """The points group of a test: its function's name without `test_`, or, for a function marked with
    points_groups, its `group` parameter."""
    if item.get_closest_marker("points_groups") is not None:
        return item.callspec.params["group"]
    return getattr(item, "originalname", item.name).removeprefix("test_")


def groups_of_function(function) -> list[str]:
    """The points groups a test function is graded as (read from the function, as the registry's checks do)."""
    marked = [mark for mark in getattr(function, "pytestmark", []) if mark.name == "points_groups"]
    return list(marked[0].args) if marked else [function.__name__.removeprefix("test_")]


class DrawnDtypes(tuple):
    """The dtypes a test module draws on this machine; `gpu_only` holds those it draws only where a GPU is present."""

    gpu_only: tuple[torch.dtype, ...] = ()


def drawn_dtypes(*everywhere: torch.dtype, gpu_only: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> DrawnDtypes:
    """`everywhere`, then `gpu_only` where a GPU is present (bfloat16 by default: Triton's interpreter computes its
    arithmetic wrongly). A test module keeps the result at its top level, where the score table finds it."""
    drawn = DrawnDtypes(everywhere + (gpu_only if torch.cuda.is_available() else ()))
    drawn.gpu_only = gpu_only
    return drawn


def dtypes_drawn_on_gpu_only(test_module: ModuleType) -> tuple[str, ...]:
    """The names of the dtypes a test module draws only where a GPU is present: those of every drawn_dtypes(...) at
    its top level. Tests skipped without a GPU say so themselves; these dtypes are left out of tests that do run."""
    found = {str(dtype).removeprefix("torch.") for value in vars(test_module).values()
             if isinstance(value, DrawnDtypes) for dtype in value.gpu_only}
    return tuple(sorted(found))
