"""One grading session's machinery behind the pytest plugin: the device and interpreter (backend), the run's
context, time budgets, lanes, the progress lines, scoring and the report, the signed results file."""
