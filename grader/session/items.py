"""Which problem a collected test grades, read from its test module through the registry. Here and not in
grader.plugin, so that the lanes (grader.session.lanes), which the plugin imports, can use it without a circle."""

from __future__ import annotations

import pytest

from assignment.registry import Problem, problem_for_test_module


def problem_of(item: pytest.Item) -> Problem | None:
    module = getattr(item, "module", None)
    return problem_for_test_module(module.__name__) if module is not None else None
