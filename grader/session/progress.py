"""One progress line per problem while `pytest grader` runs: its name, tests done out of selected, elapsed time.

On a terminal the line is rewritten in place after every test; in a log (a Slurm job's output) a line is written when
a problem finishes, and every `LOG_INTERVAL_S` while a slow one runs, so the log shows where grading is without a
line per test.
"""

from __future__ import annotations

import time
from collections import Counter

LOG_INTERVAL_S = 60.0


class Progress:
    def __init__(self, reporter, total_by_problem: dict[str, int]):
        self.reporter = reporter
        self.on_terminal = reporter is not None and reporter.isatty
        self.total = total_by_problem
        self.done: Counter[str] = Counter()
        self.statuses: dict[str, Counter[str]] = {problem_id: Counter() for problem_id in total_by_problem}
        self.started: dict[str, float] = {}
        self.last_written: dict[str, float] = {}
        self.width = max((len(problem_id) for problem_id in total_by_problem), default=0)

    def test_started(self, problem_id: str) -> None:
        now = time.monotonic()
        self.started.setdefault(problem_id, now)
        self.last_written.setdefault(problem_id, now)

    def test_finished(self, problem_id: str, status: str) -> None:
        if self.reporter is None or problem_id not in self.total:
            return
        self.done[problem_id] += 1
        self.statuses[problem_id][status] += 1
        finished = self.done[problem_id] == self.total[problem_id]
        line = self.line(problem_id)
        if self.on_terminal:
            self.reporter.rewrite(line, erase=True)
            if finished:
                self.reporter.write("\n")
        elif finished or time.monotonic() - self.last_written[problem_id] >= LOG_INTERVAL_S:
            self.reporter.write_line(line)
            self.last_written[problem_id] = time.monotonic()

    def line(self, problem_id: str) -> str:
        elapsed = time.monotonic() - self.started.get(problem_id, time.monotonic())
        counts = ", ".join(f"{n} {status}" for status, n in sorted(self.statuses[problem_id].items()))
        return (f"{problem_id.ljust(self.width)}  {self.done[problem_id]}/{self.total[problem_id]} tests  "
                f"{elapsed:5.0f} s  {counts}")
