"""One drawn TensorCase of a one-tensor kernel checked against the reference: what the gelu, row_sum and softmax
graders' test_matches_reference_fp32 / _fp16 / _bf16 (and their other tests of values) share. Those three differ only
in the cases they draw: the tolerance follows the case's dtype by itself, as the fast reference at that dtype
calibrates it. Also the invalid inputs that row_sum and softmax, both reductions over rows, refuse alike."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from assignment.registry import Problem
from grader.checks.compare import assert_close, assert_contiguous, assert_raises
from grader.checks.strategies import TensorCase
from grader.session.context import current


def check_case(student, reference, case: TensorCase, problem: Problem, function: str,
               floor_ulps: Callable[[torch.Tensor, torch.Tensor], float] | None = None, floor_unit: str = "") -> None:
    """The student's `function`(x) against the reference's `function`_torch in float64 (expected) and `function` at
    x's dtype (the calibration), both computed while the student's call runs. The floor is the problem's, or
    floor_ulps(x, expected64) where the kernel's error grows with something else than its output; when that differs
    from the problem's, the context says what the problem's floor is measured in (`floor_unit`)."""
    x = case.make(current().device)
    what = f"{function}(x)"
    with student.describing(case.describe()):
        reply, (expected64, at_dtype) = student.call_beside(
            lambda: (getattr(reference, f"{function}_torch")(x.double()), getattr(reference, function)(x)), function,
            x)
    actual = reply["value"]
    assert_contiguous(actual, what, case.describe())
    floor = problem.floor_ulps if floor_ulps is None else floor_ulps(x, expected64)
    context = case.describe()
    if floor != problem.floor_ulps:
        context += f"; the floor is {problem.floor_ulps:g} {floor_unit}"
    assert_close(actual, expected64, at_dtype, what=what, context=context, multiple=problem.error_multiple,
                 floor_ulps=floor)


# Inputs a row-wise kernel (softmax, row_sum: reductions over the last dimension) must refuse, one fault each.
ROWS_INVALID = [
    pytest.param(lambda device: torch.tensor(1.0, device=device), "ValueError", id="zero-dim"),
    pytest.param(lambda device: torch.ones(3, 0, device=device), "ValueError", id="empty-rows"),
    pytest.param(lambda device: torch.ones(3, 4, dtype=torch.int32, device=device), "TypeError", id="int32"),
    pytest.param(lambda device: torch.ones(3, 4, dtype=torch.float64, device=device), "TypeError", id="float64"),
]


def check_refuses_rows(student, function: str, make_input, expected_error: str) -> None:
    x = make_input(current().device)
    assert_raises(student.raises(function, x), expected_error,
                  f"{function}(x) for x of shape {tuple(x.shape)} and {x.dtype}")
