"""Attacks on the grade, one hostile implementation per class, each run inside the bubblewrap sandbox: each loses its
own points, and every other problem (and, for grade-all, every other student) keeps its score.

The attacks are given a private copy of the reference (`--reference`) and told where it is and where the results go
(HOSTILE_*_GUESS), as a student who knows the cluster's layout would be: what stops them is the sandbox, not secrecy.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from grader.sandbox import isolation
from tests.grading import ATTACKED_AND_BYSTANDER, ROOT, assert_fails_for, processes_with, run_grader

HOSTILE = Path(__file__).resolve().parent / "hostile"
SECRET_SEED = "918273645"

@pytest.fixture(autouse=True)
def sandbox_here():
    """The attacks are only safe to run in a sandbox (.ci/bwrap/install, run by tests/conftest.py, provides it): without
    one, each test fails before its attack starts."""
    works, why = isolation.bwrap_works()
    if not works:
        pytest.fail(f"no bwrap sandbox here: {why}")


@pytest.fixture
def reference_copy(tmp_path) -> Path:
    copy = tmp_path / "private" / "reference"
    shutil.copytree(ROOT / "reference", copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def hostile_impl(tmp_path: Path, variant: str, problem_file: str = "kernels/softmax.py") -> Path:
    impl = tmp_path / "impl"
    shutil.copytree(ROOT / "reference", impl, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(impl / "kernels" / "softmax.py", impl / "kernels" / "softmax_kernels.py")
    shutil.copy(HOSTILE / variant / problem_file, impl / problem_file)
    return impl


def assert_router_unharmed(run) -> None:
    router = run.tests_of("moe.router")
    assert router and all(t["status"] == "passed" for t in router), run.output[-3000:]


def test_forged_results_and_their_daemon_are_powerless(tmp_path, reference_copy):
    marker = uuid.uuid4().hex
    results = tmp_path / "results" / "results.json"
    run = run_grader(hostile_impl(tmp_path, "forges_results"), *ATTACKED_AND_BYSTANDER, "--source-policy", "off",
                     "--reference", str(reference_copy), results_path=results,
                     env={"HOSTILE_RESULTS_GUESS": str(results), "GRADER_TEST_RUN": marker})
    assert_fails_for(run, "kernels.softmax", "matches_reference_fp32")
    assert_router_unharmed(run)
    assert json.loads(results.read_text()) == run.results and run.results["output"] != "forged"
    time.sleep(2)  # the daemon would rewrite the file within 0.2 s, were it alive
    assert json.loads(results.read_text()) == run.results
    assert processes_with(marker) == [], "the detached daemon outlived the problem"


def test_reference_cannot_be_modified(tmp_path, reference_copy):
    before = (reference_copy / "moe" / "router.py").read_text()
    run = run_grader(hostile_impl(tmp_path, "modifies_reference"), *ATTACKED_AND_BYSTANDER, "--source-policy", "off",
                     "--reference", str(reference_copy), env={"HOSTILE_REFERENCE_GUESS": str(reference_copy)})
    assert_fails_for(run, "kernels.softmax", "matches_reference_fp32", "appended to no reference module")
    assert_router_unharmed(run)
    assert (reference_copy / "moe" / "router.py").read_text() == before


def test_a_modified_reference_aborts_the_run(tmp_path, reference_copy):
    """Without a sandbox the same attack reaches the reference; the grader notices and writes no results."""
    results = tmp_path / "results.json"
    command = [sys.executable, "-m", "pytest", "grader", "-q", "-p", "no:cacheprovider", "--profile", "ci",
               "--impl", str(hostile_impl(tmp_path, "modifies_reference")), "--reference", str(reference_copy),
               "--isolation", "none", "--source-policy", "off", "--results-json", str(results),
               *ATTACKED_AND_BYSTANDER]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HOSTILE_REFERENCE_GUESS": str(reference_copy)})
    assert done.returncode == 3, done.stdout[-3000:]
    assert "reference modified during grading (moe/router.py)" in done.stdout
    assert not results.exists()


def test_secrets_and_the_reference_cannot_be_stolen(tmp_path, reference_copy):
    run = run_grader(hostile_impl(tmp_path, "steals_secrets"), "-k", "matches_reference_fp32", "--reference",
                     str(reference_copy), "--source-policy", "off",
                     env={"GRADER_SECRET_SEED": SECRET_SEED, "HOSTILE_REFERENCE_GUESS": str(reference_copy)})
    assert_fails_for(run, "kernels.softmax", "matches_reference_fp32", "loot: cat: cat:", "No such file")
    everything = json.dumps(run.results)
    assert SECRET_SEED not in everything
    assert "MAX_SINGLE_PASS_COLS" not in everything  # a line of the reference's source


def test_one_student_cannot_touch_another(tmp_path):
    submissions = tmp_path / "submissions"
    for student in ("alice", "bob"):
        shutil.copytree(ROOT / "reference", submissions / student, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "student_impl", submissions / "mallory", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(HOSTILE / "rewrites_classmates" / "moe" / "router.py", submissions / "mallory" / "moe" / "router.py")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "grader", "grade-all", str(submissions), "--out", str(out), "--executor", "local",
         "--parallel", "3", "--profile", "ci", "--problems", "moe.router", "--select", "indices_and_gates"],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
        env={**os.environ, "HOSTILE_SCOPE": str(tmp_path), "GRADER_SOURCE_POLICY": "off"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {row["student"]: row for row in csv.DictReader(open(out / "class.csv"))}
    assert rows["alice"]["moe.router"] == rows["bob"]["moe.router"] != "0", rows
    assert rows["mallory"]["moe.router"] == "0", rows
    assert all(row["status"] == "graded" for row in rows.values()), rows
    assert (submissions / "alice" / "moe" / "router.py").read_text() == (ROOT / "reference/moe/router.py").read_text()


@pytest.mark.parametrize(
    "variant, fragments",
    [
        ("softmax_in_thread", ("called aten._softmax",)),
        ("patches_recorder", ("modified the grader's code", "ForbiddenOpRecorder.__torch_dispatch__")),
        ("patches_timer", ("modified the grader's code", "Timer.time_ms")),
        ("leaves_thread", ("left thread", "running after it returned")),
    ],
)
def test_rules_hold_in_every_thread(tmp_path, variant, fragments):
    run = run_grader(hostile_impl(tmp_path, variant), *ATTACKED_AND_BYSTANDER, "--source-policy", "off")
    assert_fails_for(run, "kernels.softmax", "matches_reference_fp32", *fragments)
    assert_router_unharmed(run)


def test_ranks_cannot_forge_training_without_communicating(tmp_path):
    """The grader's rank program cannot be replaced, and with only its own inputs a rank that does not communicate
    loses every point that rests on values; the overlap test, which rests on the rank's own records, is the one
    an attacker who forges those records keeps (the handout says so)."""
    impl = tmp_path / "impl"
    shutil.copytree(ROOT / "reference", impl, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(HOSTILE / "fakes_ddp" / "parallel" / "ddp.py", impl / "parallel" / "ddp.py")
    run = run_grader(impl, "--problem", "parallel.ddp,moe.router", "-k", "test_ddp or indices_and_gates",
                     "--source-policy", "off")
    for test in ("broadcast_at_construction", "matches_single_process", "frozen_parameter", "tied_weights"):
        assert_fails_for(run, "parallel.ddp", test)
    outside = [t for t in run.tests_of("parallel.ddp") if "overlaps_backward" not in t["name"]]
    assert all(t["score"] == 0 for t in outside), outside
    assert_router_unharmed(run)
