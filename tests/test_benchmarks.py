"""The benchmark scripts run on a GPU, never in CI; these tests keep the parts that can rot on a CPU working: what they
ask of the grader (its options, its sandbox) is what the grader takes today."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from assignment.registry import BY_ID
from grader.sandbox import isolation
from grader.session.packages import resolve
from tests.grading import ROOT


def benchmark(name: str):
    """The module benchmarks/<name>.py, imported without running its main."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(path.stem for path in (ROOT / "benchmarks").glob("*.py")))
def test_every_benchmark_imports_what_it_uses(name):
    benchmark(name)


def test_isolation_overhead_grades_the_problems_it_names():
    problems = ["kernels.gelu", "moe.router"]
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "grader", "--collect-only", "-q", "-p", "no:cacheprovider",
         *benchmark("isolation_overhead").selection(problems, before=False)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    ).stdout
    for module in ("grader/kernels/test_gelu.py", "grader/moe/test_router.py"):
        assert module + "::" in listed, listed[-2000:]


def test_speed_stability_starts_the_reference_in_the_graders_sandbox():
    level, _ = isolation.choose("auto")
    sandbox_isolation = isolation.Isolation(level)
    sandbox = benchmark("speed_stability").reference_sandbox(BY_ID["kernels.softmax"], resolve(str(ROOT / "reference")),
                                                             sandbox_isolation)
    try:
        sandbox.start()  # the worker takes the start message and imports the reference's softmax
    finally:
        sandbox.close()
        sandbox_isolation.close()
