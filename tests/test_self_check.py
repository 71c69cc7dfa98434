"""The two runs every release is checked with: the reference scores full marks, the stubs score zero cleanly."""

from __future__ import annotations

import pytest

from assignment.registry import PROBLEMS
from tests.grading import ROOT, run_grader

GRADESCOPE_TEST_KEYS = {"name", "number", "score", "max_score", "output", "visibility"}


@pytest.fixture(scope="module")
def reference_run(reference_recorded):
    return reference_recorded[0]  # recording its expectations as it grades (see tests/conftest.py)


@pytest.fixture(scope="module")
def stubs_run():
    return run_grader(ROOT / "student_impl")


def test_reference_scores_full_marks(reference_run):
    assert reference_run.returncode == 0, reference_run.output[-5000:]
    graded = [t for t in reference_run.results["tests"] if "status" in t]
    assert graded and all(t["status"] == "passed" for t in graded)
    maximum = sum(t["max_score"] for t in reference_run.results["tests"])
    assert maximum > 0 and reference_run.results["score"] == pytest.approx(maximum)
    for problem in PROBLEMS:
        assert reference_run.tests_of(problem.id), f"no test of {problem.id} ran"


def test_skips_say_why(reference_run):
    for entry in reference_run.results["tests"]:
        if "status" not in entry:
            assert entry["output"].startswith("skipped: ") and len(entry["output"]) > len("skipped: ") + 10


def test_stubs_are_not_implemented_without_traceback(stubs_run):
    assert stubs_run.returncode != 0
    assert stubs_run.results["score"] == 0
    for problem in PROBLEMS:
        tests = [t for t in stubs_run.tests_of(problem.id) if "status" in t]
        assert tests, f"no test of {problem.id} ran"
        assert all(t["output"] == "not implemented" for t in tests), tests
    assert "Traceback" not in stubs_run.output
    table = stubs_run.output[stubs_run.output.index("= score ="):]
    for problem in PROBLEMS:
        assert any(line.startswith(problem.id) and "not implemented" in line for line in table.splitlines())


def test_results_file_is_gradescope_format(stubs_run):
    results = stubs_run.results
    assert isinstance(results["score"], (int, float)) and isinstance(results["execution_time"], int)
    numbers = [t["number"] for t in results["tests"]]
    assert len(numbers) == len(set(numbers))
    for entry in results["tests"]:
        assert GRADESCOPE_TEST_KEYS <= entry.keys(), entry
        assert entry.get("status", "passed") in ("passed", "failed")
        assert entry["visibility"] == "visible"
    for key in ("machine", "gpu", "torch", "triton", "profile"):
        assert key in results["extra_data"]
