"""How an exception that ended a test becomes a status and a message."""

from __future__ import annotations

from hypothesis.errors import FlakyFailure

from grader.checks.outcomes import StudentTimedOut, WrongAnswer
from grader.session.scoring import classify


def test_a_failure_that_did_not_repeat_keeps_its_own_status():
    """Hypothesis replays a failing example; when the replay passes it raises FlakyFailure around what happened
    first. That is the student's timeout (or wrong answer), said to depend on timing, not a grader error."""
    status, message = classify(FlakyFailure("Inconsistent results", [StudentTimedOut("f() did not return")]))
    assert status == "timed out" and message.startswith("f() did not return") and "did not fail again" in message
    status, message = classify(FlakyFailure("Inconsistent results", [WrongAnswer("y: 3 values out of tolerance")]))
    assert status == "failed" and "out of tolerance" in message and "grader error" not in message


def test_anything_else_is_a_grader_error():
    assert classify(KeyError("x"))[1].startswith("grader error (KeyError")
