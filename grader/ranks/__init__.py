"""Running a problem's program on several ranks: launchers, the rank entry point, the collective recorder."""
