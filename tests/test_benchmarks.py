"""The benchmark scripts run on a GPU, never in CI; these tests keep the parts that can rot on a CPU working: what they
ask of the grader (its options, its sandbox) is what the grader takes today."""

from __future__ import annotations

import importlib.util
import os
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


def test_compile_share_times_the_tests_it_selects(capsys):
    """Two runs of the selected tests with one Triton cache; under the interpreter nothing is compiled."""
    assert benchmark("compile_share").main(["kernels.gelu", "--profile", "ci", "-k", "invalid_arguments and bool"]) == 0
    printed = capsys.readouterr().out
    assert "| test_invalid_arguments[bool] |" in printed and "| all 1 reached twice |" in printed, printed


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


BOUNDS_CHECK = """
import tempfile
from pathlib import Path

import torch

from tests.test_benchmarks import benchmark

sparse_dsa = benchmark("sparse_dsa")
generator = torch.Generator().manual_seed(0)
q = torch.randn(1, 8, 2, 16, generator=generator, requires_grad=True)
k, v = (torch.randn(1, 8, 16, generator=generator, requires_grad=True) for _ in range(2))
indices = torch.tensor([[[0, -1]] + [[0, t] for t in range(1, 8)]])  # key 0 is every query's: its dK is a sum
with tempfile.TemporaryDirectory() as folder:
    store = sparse_dsa.bound_module(Path(folder), "store_bound", sparse_dsa.plain_store)
    no_write = sparse_dsa.bound_module(Path(folder), "no_write_bound", sparse_dsa.no_write)
    grads = [torch.autograd.grad(attention(q, k, v, indices).sum(), (q, k, v))
             for attention in (sparse_dsa.sparse_attention, store.sparse_attention, no_write.sparse_attention)]
for bound in grads[1:]:
    assert torch.equal(grads[0][0], bound[0]), "dQ differs: a bound changed more than the atomic adds"
assert not torch.allclose(grads[0][1][0, 0], grads[1][1][0, 0]), "stores: key 0's dK is still a sum"
assert torch.allclose(grads[0][1][0, 1:], grads[1][1][0, 1:]), "stores: a key one query selects has another dK"
assert not grads[2][1].any() and not grads[2][2].any(), "no writes: some dK or dV row was written"
print("bounds ok")
"""


def test_the_atomic_bounds_change_only_the_backwards_atomic_adds():
    """benchmarks/sparse_dsa.py --atomic-bound's kernels, in the interpreter: the same dQ; with stores, dK rows that
    keep one query's contribution where the reference adds several; with the adds masked off, no dK or dV at all."""
    done = subprocess.run([sys.executable, "-c", BOUNDS_CHECK], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.stdout.strip() == "bounds ok", done.stdout + done.stderr[-3000:]
