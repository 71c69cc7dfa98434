"""Running student code in worker processes, apart from the grader's own process."""
