"""Running a problem's program on several ranks: launchers, the rank entry point, the collective recorder.

The machinery only: the parallel family's graded checks live in grader/parallel/, which uses it."""

# A rank result's kind when the process group did not form (grader.ranks.rank): the grader's setup failed (gloo's
# connections time out now and then on a loaded machine) before the rank imported any student code, so the launcher
# launches again once (grader.ranks.launcher.launch).
GROUP_SETUP = "group_setup"
