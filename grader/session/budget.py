"""How long student code may run in one test: a multiple of what the reference spends on the same inputs.

A fixed number of seconds is wrong on every machine but the one it was tuned on: the interpreter on two CPU cores is a
hundred times slower than a GPU, and the grading profile draws larger inputs than the public one. So each test's budget
grows with the reference's own time in the grader's process (on the same machine, on the same inputs, in the same test):
the registry's `REFERENCE_TIME_MULTIPLE` times it, never less than the problem's floor (`test_timeout_s`). The worker's
round trips and a student's slower but honest code fit in the multiple; an endless loop still ends at the budget.
"""

from __future__ import annotations

import functools
import time
import types

import torch

from assignment.registry import REFERENCE_TIME_MULTIPLE as REFERENCE_MULTIPLE
from grader import expectations


class TestBudget:
    """The student time one test may spend; the reference's calls in the test raise it."""

    def __init__(self, floor_s: float, multiple: float = REFERENCE_MULTIPLE):
        self.floor_s = floor_s
        self.multiple = multiple
        self.started = time.monotonic()
        self.reference_s = 0.0
        self.reference_calls: dict[str, float] = {}  # the last duration of each reference function, in seconds

    @property
    def total_s(self) -> float:
        return max(self.floor_s, self.multiple * self.reference_s)

    def remaining_s(self) -> float:
        return self.started + self.total_s - time.monotonic()

    def add_reference_time(self, function: str, seconds: float) -> None:
        self.reference_s += seconds
        self.reference_calls[function] = seconds

    def spent_message(self) -> str:
        return (f"this test's time for student code ({self.total_s:.0f} s: {self.multiple:g} x the "
                f"{self.reference_s:.1f} s the reference took on the same inputs, at least {self.floor_s:.0f} s) "
                "was spent")

    def reference_note(self, function: str) -> str:
        """What the reference took for the same call, for a timeout message."""
        if function in self.reference_calls:
            return f"; the reference's {function}() took {self.reference_calls[function]:.2f} s on the last inputs"
        return f"; the reference took {self.reference_s:.1f} s in this test so far"


_active: TestBudget | None = None


def begin(floor_s: float) -> TestBudget:
    """Start the budget of the test about to run."""
    global _active
    _active = TestBudget(floor_s)
    return _active


def active() -> TestBudget | None:
    return _active


class TimedReference:
    """The reference module, with every call of one of its functions counted towards the running test's budget.

    Classes and constants pass through untouched (wrapping a class would break isinstance and subclassing); a class's
    methods are not counted, which only leaves the floor for tests that use them."""

    def __init__(self, module: types.ModuleType, problem_id: str, recording: bool = False):
        self._module = module
        self._problem_id = problem_id
        self._recording = recording  # store each call's inputs and what came of them (grader.expectations)

    def __getattr__(self, name: str):
        value = getattr(self._module, name)
        if not isinstance(value, types.FunctionType):
            return value

        @functools.wraps(value)
        def timed(*args, **kwargs):
            if self._recording:
                result, seconds = expectations.record(name, value, args, kwargs)
                count_reference_time(name, seconds)
                return result
            started = time.monotonic()
            try:
                return value(*args, **kwargs)
            finally:
                count_reference_time(name, time.monotonic() - started)

        return timed

    def computed(self, function, *args):
        """function(reference module, *args), as one call: recorded and replayed whole (grader.expectations), for
        grader code that inspects the reference's own autograd graph, which a recorded call's value does not carry.
        Its calls of the reference are timed as any."""
        if not self._recording:
            return function(self, *args)
        result, seconds = expectations.record(function.__qualname__, lambda *a: function(self._module, *a), args, {})
        count_reference_time(function.__qualname__, seconds)
        return result

    def __repr__(self) -> str:
        # Hypothesis prints a failing test's arguments: name the problem, not the reference's path.
        return f"<reference {self._problem_id}>"


class ReplayedReference:
    """The reference's functions as the stored expectations remember them: each call returns the recorded value
    for the same inputs (grader.expectations), and counts the seconds the reference took for it when recorded."""

    def __init__(self, problem_id: str):
        self._problem_id = problem_id

    def __getattr__(self, name: str):
        if name.startswith("_"):  # hypothesis's printer asks for _repr_pretty_; no reference function is private
            raise AttributeError(name)

        def replayed(*args, **kwargs):
            device = next((t.device for t in expectations.plain_tensors((args, kwargs))), torch.device("cpu"))
            result, seconds = expectations.replay(name, args, kwargs, device)
            count_reference_time(name, seconds)
            return result

        replayed.__name__ = name
        return replayed

    def computed(self, function, *args):
        """What TimedReference.computed recorded for function(reference, *args)."""
        return getattr(self, function.__qualname__)(*args)

    def __repr__(self) -> str:
        return f"<reference {self._problem_id}>"


def count_reference_time(function: str, seconds: float) -> None:
    """Add the reference's seconds for one call to the running test's budget (none outside a test)."""
    if _active is not None:
        _active.add_reference_time(function, seconds)


def untimed(reference) -> types.ModuleType:
    """The module behind a TimedReference: speed tests time the reference themselves, without the wrapper's cost."""
    return reference._module if isinstance(reference, TimedReference) else reference
