"""`python -m assignment new-problem` on a copy of the project: the skeleton has every place the tests require, the
tests name what is unfilled, the grader runs its one test, and `remove-problem` leaves the copy as it was."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from tests.grading import ROOT, run_grader

PROBLEM_ID = "kernels.throwaway_example"


def project_copy(destination) -> None:
    """The files git knows of (tracked, and untracked but not ignored), as a clone would hold them and more."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file() and not source.is_symlink():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            (destination / name).write_bytes(source.read_bytes())


def digests(root) -> dict[str, str]:
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file() and "__pycache__" not in path.parts}


def assignment_command(root, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "assignment", *args, "--root", str(root)], cwd=root,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    root = tmp_path_factory.mktemp("project")
    project_copy(root)
    return root


def test_a_new_problem_is_a_skeleton_the_tests_name_until_filled_and_removing_it_restores_the_project(copy):
    before = digests(copy)
    made = assignment_command(copy, "new-problem", PROBLEM_ID)
    assert made.returncode == 0, made.stderr
    for path in ("student_impl/kernels/throwaway_example.py", "reference/kernels/throwaway_example.py",
                 "grader/kernels/test_throwaway_example.py",
                 "assignment/handout/sections/kernels/throwaway_example.typ"):
        assert (copy / path).is_file(), made.stdout
    again = assignment_command(copy, "new-problem", PROBLEM_ID)
    assert again.returncode != 0 and "exists already" in again.stderr

    # The registry's checks of the five places, signatures and points hold; the unfilled places are named.
    registry = subprocess.run([sys.executable, "-m", "pytest", "tests/test_registry.py", "-q", "-p", "no:cacheprovider",
                               "-k", "throwaway_example"], cwd=copy, capture_output=True, text=True)
    assert "1 failed" in registry.stdout, registry.stdout[-3000:]
    assert "test_no_place_is_left_unfilled[kernels.throwaway_example]" in registry.stdout
    for place in ("student_impl", "reference", "grader module", "handout section", "registry entry",
                  "lane seconds, estimated"):
        assert place in registry.stdout, place

    # The grader collects the new module and grades its one test: the stub is "not implemented".
    graded = run_grader(copy / "student_impl", "--problem", PROBLEM_ID, cwd=copy)
    tests = [t for t in graded.tests_of(PROBLEM_ID) if "status" in t]
    assert [t["output"] for t in tests] == ["not implemented"], graded.output[-3000:]

    removed = assignment_command(copy, "remove-problem", PROBLEM_ID)
    assert removed.returncode == 0, removed.stderr
    assert digests(copy) == before


@pytest.mark.parametrize("problem_id", ["kernels", "optim.adam", "kernels.Layer", "moe.analysis", "kernels.gelu"])
def test_a_bad_or_taken_id_is_refused_and_nothing_is_written(copy, problem_id):
    before = digests(copy)
    made = assignment_command(copy, "new-problem", problem_id)
    assert made.returncode != 0 and ("exists already" in made.stderr or "lower_snake_case" in made.stderr)
    assert digests(copy) == before
