"""`--world-sizes` replaces the registry's numbers of ranks for every distributed problem's main tests."""

from __future__ import annotations

import subprocess
import sys

from tests.grading import ROOT


def collect(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "grader/parallel/test_ddp.py", "--collect-only", "-q",
               "-p", "no:cacheprovider",
               "-k", "matches_single_process", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_world_sizes_replace_the_registry_s():
    collected = collect("--world-sizes", "3,8").stdout
    assert "test_matches_single_process[3]" in collected and "test_matches_single_process[8]" in collected
    assert "test_matches_single_process[2]" not in collected, collected


def test_a_malformed_list_is_a_usage_error():
    completed = collect("--world-sizes", "four")
    assert completed.returncode == 4  # pytest's usage error
    assert "--world-sizes takes numbers such as 4,8, not 'four'" in completed.stdout + completed.stderr
