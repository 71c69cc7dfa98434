"""The grader's own time limit on each of its tests, through pytest-timeout: the limit above every other limit.

Student code is bounded by its worker's and its ranks' limits (grader.session.budget, the launchers). This one bounds
the grader itself: a bug in the grader's own code (a wait with no end, an oracle that never returns) fails one test as
"timed out (grader)" and the rest of the grading goes on. It is pytest-timeout's `timeout` marker, set on every
grader test, with the alarm handled here: the handler raises a BaseException, which hypothesis does not catch (no
shrinking replays of a hang), and the limit follows the test's student budget when the reference's time raises it.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from grader.checks.outcomes import StudentAbort
from grader.sandbox.client import START_TIMEOUT_S
from grader.session import budget

# Room for the grader's own work in a test besides student code: the reference's calls (at most a tenth of the
# student budget, see grader.session.budget), drawing inputs, comparing, starting a worker.
MARGIN_S = START_TIMEOUT_S + 120.0


class GraderTimedOut(StudentAbort):
    status = "timed out (grader)"


def limit_s(student_budget_s: float) -> float:
    return 2 * student_budget_s + MARGIN_S


def mark(item: pytest.Item, student_budget_s: float) -> None:
    """Give a grader test its outer limit, unless it (or the command line) set its own."""
    if item.get_closest_marker("timeout") is None and item.config.getoption("timeout", None) is None:
        item.add_marker(pytest.mark.timeout(limit_s(student_budget_s)))


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings) -> bool | None:
    if threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own thread method
    started = time.monotonic()

    def seconds_left() -> float:
        test_budget = budget.active()
        total = settings.timeout
        if test_budget is not None and test_budget.started >= started:
            total += 2 * (test_budget.total_s - test_budget.floor_s)  # what the reference's time added, twice
        return started + total - time.monotonic()

    def on_alarm(signum, frame) -> None:
        left = seconds_left()
        if left > 0:  # the reference's time raised the budget since the alarm was set
            signal.setitimer(signal.ITIMER_REAL, left)
            return
        raise GraderTimedOut(
            f"the grader's own work on this test did not finish within {time.monotonic() - started:.0f} s; "
            "please report it to the course staff"
        )

    def cancel() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True
