"""Hostile student code costs only its own problem and cannot change a verdict.

The out-of-bounds case relies on Triton's interpreter (the bounds check), so these tests run on CPU machines.

Each hostile softmax is placed in a copy of the reference package, so the same grading run also grades a correct
router: it must still get full marks.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from grader.sandbox import isolation
from tests.grading import ATTACKED_AND_BYSTANDER, ROOT, assert_fails_for, processes_with, run_grader

HOSTILE = Path(__file__).resolve().parent / "hostile"


def impl_with_hostile_softmax(tmp_path: Path, variant: str) -> Path:
    impl = tmp_path / "impl"
    shutil.copytree(ROOT / "reference", impl, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(HOSTILE / variant / "kernels" / "softmax.py", impl / "kernels" / "softmax.py")
    return impl


def assert_router_unharmed(run) -> None:
    router = run.tests_of("moe.router")
    assert router and all(t["status"] == "passed" for t in router), run.output[-3000:]


@pytest.mark.parametrize(
    "variant, status, fragments",
    [
        ("segfault", "crashed", ("died", "SIGSEGV")),
        ("exits", "crashed", ("died", "exited with status 0")),
        ("hang", "timed out", ("did not return within",)),
        ("out_of_bounds", "failed", ("out-of-bounds store in Triton kernel `_scribble_kernel`",)),
    ],
)
def test_crash_or_hang_costs_only_its_problem(tmp_path, variant, status, fragments):
    started = time.monotonic()
    run = run_grader(
        impl_with_hostile_softmax(tmp_path, variant),
        *ATTACKED_AND_BYSTANDER,
        "--timeout-scale", "0.1",
        "--source-policy", "off",
    )
    assert_fails_for(run, "kernels.softmax", "matches_reference_fp32", *fragments, status=status)
    assert "inputs: shape=" in run.failures("kernels.softmax")[0]["output"]
    assert_router_unharmed(run)
    assert "score" in run.output and "total" in run.output
    assert time.monotonic() - started < 120


def test_missing_module_costs_only_its_problem(tmp_path):
    """A package without one problem's file: that problem is "not implemented" and the problem graded after it keeps
    its marks (the check is not a fixture, which pytest 9.1 would leave failing the next test that uses it)."""
    impl = tmp_path / "impl"
    shutil.copytree(ROOT / "reference", impl, ignore=shutil.ignore_patterns("__pycache__"))
    (impl / "kernels" / "gelu.py").unlink()  # gelu's tests run before softmax's
    run = run_grader(impl, "-k", "invalid_arguments and (gelu or softmax)")
    gelu, softmax = run.tests_of("kernels.gelu"), run.tests_of("kernels.softmax")
    assert gelu and all(t["output"].startswith("not implemented") for t in gelu), run.output[-3000:]
    assert softmax and all(t["status"] == "passed" for t in softmax), run.output[-3000:]


def test_patched_checks_change_no_verdict(tmp_path):
    run = run_grader(impl_with_hostile_softmax(tmp_path, "patches_checks"), "--problem", "kernels.softmax,moe.router",
                     "-k", "matches_reference or indices_and_gates", "--source-policy", "off")
    # Its constant 0.5 is caught as constant, or (where shrinking reaches a one-column row) as out of tolerance.
    for test in ("matches_reference_fp32", "matches_reference_fp16"):
        assert_fails_for(run, "kernels.softmax", test, "softmax(x):")
        output = next(t["output"] for t in run.failures("kernels.softmax") if test in t["name"])
        assert "expected output is not constant" in output or "got 0.5, expected 1" in output, output
    assert_router_unharmed(run)


@pytest.mark.parametrize("level, refusal", [("bwrap", "No such file or directory"),
                                             ("none", "may not read the reference")])
def test_reference_can_be_neither_imported_nor_read(level, refusal):
    """In the sandbox the reference is not there; without it, the worker's audit hook refuses the read."""
    run = run_grader(HOSTILE / "steals_reference", "-k", "matches_reference_fp32", "--isolation", level,
                     "--source-policy", "off", env={"HOSTILE_REFERENCE_GUESS": str(ROOT / "reference")})
    assert_fails_for(run, "kernels.softmax", "matches_reference_fp32", "may not import the reference package", refusal)


def test_no_worker_outlives_the_run(tmp_path):
    marker = f"GRADER_TEST_RUN={uuid.uuid4().hex}"
    name, value = marker.split("=")
    run_grader(impl_with_hostile_softmax(tmp_path, "hang"), "-k", "matches_reference_fp32", "--timeout-scale", "0.05",
               env={name: value})
    time.sleep(0.5)
    assert processes_with(marker) == [], "worker processes outlived the grading run"


def test_uid_level_keeps_student_code_out_of_a_private_reference(tmp_path):
    """Where bwrap cannot run, a root grader runs student code as an unprivileged uid, which cannot read a private
    reference. Where such a uid cannot run the grader's Python (a Python under /root, say), or the grader is not root,
    the level is refused with the reason instead."""
    unavailable = isolation.uid_unavailable()
    if unavailable is not None:
        done = subprocess.run([sys.executable, "-m", "pytest", "grader", "-q", "-p", "no:cacheprovider",
                               "--isolation", "uid", "-k", "nothing"], cwd=ROOT, capture_output=True, text=True)
        assert f"--isolation uid: {unavailable}" in done.stdout + done.stderr and done.returncode == 4
        return
    private = tmp_path / "private"
    shutil.copytree(ROOT / "reference", private / "reference", ignore=shutil.ignore_patterns("__pycache__"))
    private.chmod(0o700)
    run = run_grader(HOSTILE / "steals_reference", "-k", "matches_reference_fp32", "--isolation", "uid",
                     "--reference", str(private / "reference"), "--source-policy", "off",
                     env={"HOSTILE_REFERENCE_GUESS": str(private / "reference")})
    assert_fails_for(run, "kernels.softmax", "matches_reference_fp32", "may not import the reference package",
                     "Permission denied")
    assert "isolation: uid" in run.results["output"]


def test_uid_level_refuses_a_readable_reference():
    readable = Path(tempfile.mkdtemp(prefix="readable-"))
    readable.chmod(0o755)
    shutil.copytree(ROOT / "reference", readable / "reference", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pytest", "grader", "-q", "-p", "no:cacheprovider", "--isolation",
                           "uid", "--reference", str(readable / "reference"), "-k", "nothing"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    shutil.rmtree(readable)
    reason = isolation.uid_unavailable() or "could read the reference"
    assert reason in done.stdout + done.stderr and done.returncode == 4
