"""Running a problem's program on several ranks: launchers, the rank entry point, the collective recorder.

The machinery only: the parallel family's graded checks live in grader/parallel/, which uses it."""
