"""Running `pytest grader` as a subprocess, the way students and instructors do, and reading its results file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# An attack on kernels.softmax graded with a problem graded after it: its one test the attack must fail, and one test
# of moe.router, which must keep its marks (nothing one problem's code does reaches another's verdict).
ATTACKED_AND_BYSTANDER = ("--problem", "kernels.softmax,moe.router",
                          "-k", "matches_reference_fp32 or indices_and_gates")


@dataclass
class GraderRun:
    returncode: int
    output: str
    results: dict

    def tests_of(self, problem_id: str) -> list[dict]:
        return [t for t in self.results["tests"] if t["name"].startswith(problem_id + " ::")]

    def failures(self, problem_id: str) -> list[dict]:
        return [t for t in self.tests_of(problem_id) if t.get("status") == "failed"]


def run_grader(impl: str | Path, *pytest_args: str, profile: str = "ci", timeout_s: float = 900,
               env: dict | None = None, results_path: Path | None = None,
               tests: Sequence[str] = ("grader",), cwd: Path = ROOT) -> GraderRun:
    """`tests`: what pytest collects, the whole grader or node ids such as grader/moe/test_router.py::test_losses;
    `cwd`: the repository whose grader runs (a students' copy, say)."""
    with tempfile.TemporaryDirectory() as scratch:
        results_path = results_path or Path(scratch) / "results.json"
        command = [sys.executable, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
                   "--impl", str(impl), "--profile", profile, "--results-json", str(results_path), *pytest_args]
        completed = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                                   env={**os.environ, **(env or {})})
        output = completed.stdout + completed.stderr
        assert results_path.exists(), f"the grader wrote no results file:\n{output}"
        return GraderRun(completed.returncode, output, json.loads(results_path.read_text()))


def assert_fails_for(run: GraderRun, problem_id: str, test: str, *fragments: str, status: str = "failed") -> None:
    """The named test (a substring of its name) failed, and its output names the fault by every fragment."""
    matching = [t for t in run.tests_of(problem_id) if test in t["name"]]
    assert matching, f"no test matching {test!r} ran for {problem_id}:\n{run.output[-3000:]}"
    failed = [t for t in matching if t.get("status") == "failed"]
    assert failed, f"{test} passed for a wrong implementation of {problem_id}:\n{run.output[-3000:]}"
    for entry in failed:
        assert entry["output"].startswith(status), f"expected status {status!r}, got: {entry['output']}"
        missing = [f for f in fragments if f.lower() not in entry["output"].lower()]
        assert not missing, f"{entry['name']} failed without naming {missing}:\n{entry['output']}"
    assert run.returncode != 0


def beside_parallel_sheet(folder: Path, module: str, source: str, answers: dict) -> Path:
    """An implementation package holding `source` as parallel/<module>.py and the reference's parallel.analysis sheet
    with `answers` written over its own: a measured question graded on the code it measures."""
    (folder / "parallel").mkdir(parents=True)
    (folder / "parallel" / f"{module}.py").write_text(source)
    sheet = (ROOT / "reference" / "parallel" / "analysis.py").read_text()
    for key, value in answers.items():
        line = next(line for line in sheet.splitlines() if line.strip().startswith(f'"{key}":'))
        sheet = sheet.replace(line, f'    "{key}": {value},')
    (folder / "parallel" / "analysis.py").write_text(sheet)
    return folder


def processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds `marker`: a run's own workers and ranks, whatever else runs here."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue  # exited meanwhile, or not ours to read
    return found
