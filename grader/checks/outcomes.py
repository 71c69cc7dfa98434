"""How a call into student code can end, as exceptions the grader's tests raise.

`StudentAbort` subclasses derive from BaseException on purpose: hypothesis shrinks ordinary exceptions by replaying
smaller inputs, which is right for a wrong answer but wasteful for a stub that is not implemented and ruinous for a
crash or a hang (every replay would restart a worker or wait out a time limit). A BaseException ends the test at once
with the input that caused it.
"""

from __future__ import annotations


class StudentAbort(BaseException):
    status = "crashed"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class NotImplementedByStudent(StudentAbort):
    status = "not implemented"


class StudentCrashed(StudentAbort):
    status = "crashed"


class StudentTimedOut(StudentAbort):
    status = "timed out"


class GradingFailure(AssertionError):
    """A graded failure: hypothesis may shrink the input that causes it."""


class WrongAnswer(GradingFailure):
    pass


class StudentError(GradingFailure):
    """Student code raised an exception (other than NotImplementedError)."""

    def __init__(self, message: str, type_names: tuple[str, ...] = (), raised: str = ""):
        super().__init__(message)
        self.type_names = type_names  # the exception's class and its bases, by name
        self.raised = raised  # "Type: message"


class RuleViolation(GradingFailure):
    """The answer may be right but the work was not done as the problem requires (e.g. the library op was called)."""
