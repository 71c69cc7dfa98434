"""The Gradescope autograder end to end: built by `python -m grader gradescope`, unpacked into a stand-in for
/autograder, and run by its own run_autograder on uploads shaped the ways students upload."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from grader.release.gradescope import ROOT_VARIABLE
from tests.grading import ROOT
from tests.mutants import WRONG, load, materialise

PROBLEM = "moe.accounting"
WRONG_VARIANT = "activated_without_shared"


@pytest.fixture(scope="module")
def autograder_zip(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gradescope") / "autograder.zip"
    subprocess.run([sys.executable, "-m", "grader", "gradescope", str(out), "--profile", "public", "--problems",
                    PROBLEM], cwd=ROOT, check=True, capture_output=True, text=True)
    return out


def run_autograder(zip_path: Path, root: Path, upload) -> dict:
    """Gradescope's steps: the zip unpacked into source/, run_autograder beside it, the upload in submission/."""
    with zipfile.ZipFile(zip_path) as archive:
        archive.extractall(root / "source")
    shutil.copy(root / "source" / "run_autograder", root / "run_autograder")
    (root / "submission").mkdir()
    upload(root / "submission")
    subprocess.run(["bash", str(root / "run_autograder")], env={**os.environ, ROOT_VARIABLE: str(root)},
                   check=True, capture_output=True, text=True, timeout=600)
    return json.loads((root / "results" / "results.json").read_text())


def test_zip_holds_the_scripts_and_the_reference_but_no_tests(autograder_zip):
    names = zipfile.ZipFile(autograder_zip).namelist()
    assert {"setup.sh", "run_autograder", "gradescope.json"} <= set(names)
    assert any(name.startswith("reference/moe/") for name in names)
    assert not any(name.startswith(("tests/", "benchmarks/")) or "__pycache__" in name for name in names)
    info = zipfile.ZipFile(autograder_zip).getinfo("run_autograder")
    assert (info.external_attr >> 16) & 0o111, "run_autograder must be executable"


def test_reference_copy_gets_full_marks(autograder_zip, tmp_path):
    results = run_autograder(autograder_zip, tmp_path,
                             lambda upload: shutil.copytree(ROOT / "reference", upload / "student_impl"))
    assert results["tests"] and results["score"] == sum(test["max_score"] for test in results["tests"])
    assert "signature" in results  # the grader's own, checked before it was copied out


def test_stubs_get_zero(autograder_zip, tmp_path):
    results = run_autograder(autograder_zip, tmp_path,
                             lambda upload: shutil.copytree(ROOT / "student_impl", upload / "repo" / "student_impl"))
    assert results["tests"] and results["score"] == 0
    assert all(test["output"].startswith("not implemented") for test in results["tests"])


def test_wrong_implementation_loses_its_points(autograder_zip, tmp_path):
    mutant = load(WRONG.joinpath(*PROBLEM.split(".")) / WRONG_VARIANT)
    results = run_autograder(autograder_zip, tmp_path, lambda upload: materialise([mutant], upload))
    full = sum(test["max_score"] for test in results["tests"])
    failed = [test for test in results["tests"] if test.get("status") == "failed"]
    assert 0 < results["score"] < full
    assert any(mutant.test in test["name"] for test in failed), [test["name"] for test in failed]


def test_upload_without_implementation_is_not_graded(autograder_zip, tmp_path):
    results = run_autograder(autograder_zip, tmp_path, lambda upload: (upload / "notes.txt").write_text("hi"))
    assert results["score"] == 0 and results["tests"] == []
    assert "no implementation in the upload" in results["output"]
