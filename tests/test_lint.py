"""The code stays clean by the linter pyproject.toml configures (ruff: pycodestyle, pyflakes, import order, blind
excepts, and no stale noqa): a lint error fails CI."""

from __future__ import annotations

import subprocess
import sys

from tests.grading import ROOT


def test_the_linter_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
