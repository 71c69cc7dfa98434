"""A student's loop: stubs answered from their source, exact selection, a readable report, the grader's own limit.

Times are recorded by benchmarks/grading_time.py; these tests check behaviour only.
"""

from __future__ import annotations

import ast
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grader.checks import stubs
from grader.session import budget
from tests.grading import ROOT, run_grader

STUB_SOURCE = '''
import torch

def done(x):
    """Implemented."""
    return x + 1

def todo(x):
    """The stub."""
    raise NotImplementedError

class Model:
    def __init__(self):
        raise NotImplementedError("write me")

    def forward(self, x):
        "Also a stub."
        raise NotImplementedError()

def looks_done_but_is_not_a_stub(x):
    if x is None:
        raise NotImplementedError
    return x
'''


def test_stub_functions_are_read_from_the_source(tmp_path):
    module = tmp_path / "module.py"
    module.write_text(STUB_SOURCE)
    assert stubs.stub_functions(module) == {"todo", "Model.__init__", "Model.forward"}
    assert not stubs.all_stubs(module)
    module.write_text("def f():\n    '''doc'''\n    raise NotImplementedError\n")
    assert stubs.all_stubs(module)
    module.write_text("def f(:\n")  # does not parse: importing it in the worker reports the error
    assert stubs.stub_functions(module) == frozenset() and not stubs.all_stubs(module)


def test_every_shipped_stub_module_is_all_stubs():
    for module in (ROOT / "student_impl").rglob("*.py"):
        if module.name != "__init__.py":
            assert stubs.all_stubs(module), module


def with_one_function_stubbed(tmp_path: Path, problem_path: str, function: str) -> Path:
    """A copy of the reference where `function` of one problem is the stub again, the rest done."""
    impl = tmp_path / "impl"
    shutil.copytree(ROOT / "reference", impl, ignore=shutil.ignore_patterns("__pycache__"))
    module = impl / problem_path
    lines = module.read_text().splitlines()
    node = next(n for n in ast.parse(module.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == function)
    has_docstring = isinstance(node.body[0], ast.Expr)
    body_start = node.body[0].end_lineno if has_docstring else node.body[0].lineno - 1
    module.write_text("\n".join(lines[:body_start] + ["    raise NotImplementedError"] + lines[node.end_lineno:]))
    return impl


def test_a_problem_half_done_grades_what_is_done(tmp_path):
    impl = with_one_function_stubbed(tmp_path, "parallel/accounting.py", "bytes_per_parameter")
    run = run_grader(impl, "--problem", "parallel.accounting")
    tests = run.tests_of("parallel.accounting")
    stubbed = [t for t in tests if "test_bytes_per_parameter" in t["name"]]
    done = [t for t in tests if "test_communication_volume" in t["name"] or "activations" in t["name"]]
    assert stubbed and all(t["output"] == "not implemented" for t in stubbed), stubbed
    assert done and all(t["status"] == "passed" for t in done), run.output[-3000:]
    assert [t["name"] for t in run.results["tests"]] == [t["name"] for t in tests], "another problem was graded"


def collected(*args: str) -> set[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "grader", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}


def test_problem_option_selects_exactly_that_problem():
    assert collected("--problem", "moe.router") == {"grader/moe/test_router.py"}
    assert collected("--problem", "kernels.softmax,parallel.ddp") == {"grader/kernels/test_softmax.py",
                                                                      "grader/parallel/test_ddp.py"}
    done = subprocess.run([sys.executable, "-m", "pytest", "grader", "--problem", "moe.ruoter", "-q"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "unknown problem moe.ruoter" in done.stdout + done.stderr


def test_stubs_print_no_failure_sections_and_one_progress_line_per_problem():
    run = run_grader(ROOT / "student_impl", "--problem", "moe.router,kernels.gelu")
    assert "FAILURES" not in run.output and "= failures =" not in run.output, run.output
    assert "moe.router" in run.output and any(
        line.startswith("moe.router") and "not implemented" in line and "tests" in line
        for line in run.output.splitlines()
    ), run.output
    table = run.output[run.output.index("= score ="):]
    assert "moe.sigmoid_router" not in table and "kernels.softmax" not in table


def test_the_grader_own_limit_fails_a_test_and_grading_goes_on():
    """pytest-timeout's limit, set tiny here, stands for a grader bug that hangs: "timed out (grader)", the rest
    still graded, and the failure says how to rerun that one test."""
    run = run_grader(ROOT / "reference", "--problem", "moe.accounting", "--timeout", "0.2")
    tests = [t for t in run.tests_of("moe.accounting") if "status" in t]
    timed_out = [t for t in tests if t["output"].startswith("timed out (grader)")]
    assert timed_out and len(tests) == len(run.tests_of("moe.accounting")), run.output[-3000:]
    assert "= score =" in run.output
    lines = [line.strip() for line in run.output.splitlines() if line.strip().startswith("reproduce: ")]
    assert lines, run.output[-3000:]
    command = shlex.split(lines[0].removeprefix("reproduce: "))
    assert command[1].startswith("grader/moe/test_accounting.py::test_"), command
    rerun = subprocess.run([sys.executable, "-m", *command, "--collect-only", "-q", "-p", "no:cacheprovider"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert [line for line in rerun.stdout.splitlines() if "::" in line] == [command[1]], rerun.stdout


def test_budget_grows_with_the_reference_time():
    test_budget = budget.begin(floor_s=5.0)
    assert test_budget.total_s == 5.0
    test_budget.add_reference_time("f", 2.0)
    assert test_budget.total_s == pytest.approx(2.0 * budget.REFERENCE_MULTIPLE)
    assert "f() took 2.00 s" in test_budget.reference_note("f")
    assert test_budget.remaining_s() <= test_budget.total_s


def test_timed_reference_counts_function_calls_only():
    import types

    module = types.ModuleType("fake")
    module.slow = lambda: time.sleep(0.05) or 7
    module.Thing = type("Thing", (), {})
    timed = budget.TimedReference(module, "moe.fake")
    test_budget = budget.begin(floor_s=0.0)
    assert timed.slow() == 7 and test_budget.reference_s >= 0.05
    assert timed.Thing is module.Thing and budget.untimed(timed) is module
    assert repr(timed) == "<reference moe.fake>"


def test_a_small_failing_case_shows_its_values():
    import torch

    from grader.checks.compare import SHOWN_WHOLE
    from grader.checks.strategies import TensorCase

    small = TensorCase(shape=(2, 2), dtype=torch.float32, layout="contiguous", regime="normal", seed=5)
    shown = small.describe().partition("elements=")[2]
    values = [float(v) for v in shown.replace("[", "").replace("]", "").split(", ")]
    assert shown.startswith("[[") and values == pytest.approx(small.make("cpu").flatten().tolist(), rel=1e-6)
    large = TensorCase(shape=(SHOWN_WHOLE + 1,), dtype=torch.float32, layout="contiguous", regime="normal", seed=5)
    assert "elements=" not in large.describe()
