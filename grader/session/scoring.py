"""Turning test outcomes into statuses and points."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis.errors import Unsatisfiable

from assignment.registry import Problem
from grader.checks.outcomes import GradingFailure, StudentAbort
from grader.expectations import DrawsDiffer

# A problem's status is the first of these that any of its tests has (skipped only if every test was skipped).
STATUS_ORDER = ("crashed", "timed out", "timed out (grader)", "failed", "not graded", "not implemented", "passed",
                "skipped")


@dataclass
class TestResult:
    nodeid: str
    problem: Problem
    group: str
    share: float  # points this test is worth: its group's points over the group's number of tests
    status: str = "passed"
    message: str = ""
    duration_s: float = 0.0
    fraction: float = 1.0  # of the share a passed test earns: below 1 for a speed test in a lower tier
    detail: str = ""  # a failure in full: status, message, the failing input, how to reproduce it

    @property
    def score(self) -> float:
        return self.share * self.fraction if self.status == "passed" else 0.0

    @property
    def max_score(self) -> float:
        return 0.0 if self.status == "skipped" else self.share

    @property
    def short_reason(self) -> str:
        first = self.message.strip().splitlines()[0] if self.message.strip() else self.status
        return f"{self.group}: {first}"


def classify(error: BaseException) -> tuple[str, str]:
    """(status, message) for an exception that ended a test."""
    if isinstance(error, BaseExceptionGroup) and error.exceptions:
        # Hypothesis groups the failures of an example that did not fail again when replayed (FlakyFailure): the
        # first one is what happened; that it did not repeat is worth saying, not a grader error. An exception group
        # holds only Exceptions: a student's crash or timeout (a BaseException) is the cause of its wrapper.
        first = error.exceptions[0]
        status, message = classify(first.__cause__ if type(first).__name__ == "_WrappedBaseException" else first)
        return status, f"{message}\n(replayed on the same input, it did not fail again: it depends on timing or load)"
    if isinstance(error, (StudentAbort, DrawsDiffer)):
        return error.status, error.message
    if isinstance(error, Unsatisfiable):
        return DrawsDiffer.status, ("no drawn input had a stored expectation: this machine draws other inputs than "
                                    "those recorded for the students' copy")
    if isinstance(error, GradingFailure):
        return "failed", str(error)
    # Anything else escaped the grader's own checks: report it plainly rather than hide it.
    return "failed", f"grader error ({type(error).__name__}: {error}); please report it to the course staff"


@dataclass
class ProblemScore:
    problem: Problem
    results: list[TestResult] = field(default_factory=list)

    @property
    def score(self) -> float:
        return sum(r.score for r in self.results)

    @property
    def max_score(self) -> float:
        return sum(r.max_score for r in self.results)

    @property
    def skipped_points(self) -> float:
        return sum(r.share for r in self.results if r.status == "skipped")

    @property
    def status(self) -> str:
        statuses = {r.status for r in self.results}
        graded = statuses - {"skipped"}
        if not graded:
            return "skipped"
        return next(s for s in STATUS_ORDER if s in graded)

    @property
    def reason(self) -> str:
        for status in STATUS_ORDER[: STATUS_ORDER.index("not implemented") + 1]:
            for result in self.results:
                if result.status == status:
                    return result.short_reason
        # A pass that earned part of its points says why; so does a full pass with a note (what it could check here).
        noted = [r for r in self.results if r.status == "passed" and (r.fraction < 1 or r.message)]
        return noted[0].short_reason if noted else ""


def by_problem(results: list[TestResult]) -> list[ProblemScore]:
    scores: dict[str, ProblemScore] = {}
    for result in results:
        scores.setdefault(result.problem.id, ProblemScore(result.problem)).results.append(result)
    return list(scores.values())
