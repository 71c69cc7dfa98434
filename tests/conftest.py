"""Tests of the grader itself. Triton's interpreter must be chosen before triton is first imported, and the sandbox
that student code runs in must be installed before any test grades (as the Slurm cluster is, by the tests that need
it)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from grader.session.backend import use_interpreter_without_gpu

use_interpreter_without_gpu()

if shutil.which("bwrap") is None and os.geteuid() == 0:
    subprocess.run([str(Path(__file__).resolve().parents[1] / ".ci" / "bwrap" / "install")], check=True)


def pytest_configure(config):
    # The grader's marks, which these tests meet when they import a grader test module (tests/test_registry.py).
    from grader.checks.marks import MARKERS

    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")
    # CI's log names the slowest tests of the grader's own suite, which must stay within half of CI's time.
    # Only for this suite: a grader run given `--impl tests/...` loads this file too.
    if not config.getoption("durations") and all(Path(arg).parts[:1] == ("tests",) for arg in config.args):
        config.option.durations = 25


@pytest.fixture(scope="session")
def reference_recorded(tmp_path_factory):
    """The reference graded with the ci profile, as `python -m grader release` records it: (the run, the folder of
    its expectations). The self-check reads the run; the students' copy below is built from the folder."""
    from tests.grading import ROOT, run_grader

    folder = tmp_path_factory.mktemp("expectations")
    # In two lanes (`--jobs 2`, whole problems each), one for each of CI's cores: the largest run of the suite.
    return run_grader(ROOT / "reference", "--record-expectations", str(folder), "--jobs", "2"), folder


@pytest.fixture(scope="session")
def students_copy(reference_recorded, tmp_path_factory):
    """A students' copy of every problem (no reference in it) holding the ci profile's expectations."""
    from grader.release import students_copy as release

    run, folder = reference_recorded
    if run.returncode != 0:
        pytest.fail(f"the reference did not pass, so nothing was recorded:\n{run.output[-3000:]}")
    return release.assemble(tmp_path_factory.mktemp("release") / "copy", folder, ("ci",))


@pytest.fixture
def float64_by_default():
    """float64 as torch's default dtype while one test runs (the handout's formula checks), and back after it."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
