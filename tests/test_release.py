"""The students' copy (`python -m grader release`): no reference code in it, and its grader, replaying the stored
expectations, gives the live grader's verdicts.

The copy (tests/conftest.py) holds the ci profile's expectations of every problem, recorded by the self-check's run
of the reference; tests/test_wrong.py grades every wrong implementation in it as well. Here, whole problems are
graded live and in the copy, chosen to cover every way a test takes values from the reference: plain calls
(kernels.softmax), gradients sent back through the reference's value (kernels.rmsnorm, moe.router, moe.capacity), a
call whose effect is the gradients it leaves in modules' parameters (parallel.pipeline's single-process step), and a
computation that looks into the reference's autograd node (kernels.flash_attention_torch)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from grader import expectations
from grader.release import students_copy as release
from tests import mutants
from tests.grading import ROOT, run_grader

PROBLEMS = ("kernels.softmax", "kernels.rmsnorm", "kernels.flash_attention_torch", "moe.capacity", "moe.router",
            "parallel.pipeline")
WRONG = ("kernels.softmax/no_max_subtraction", "kernels.rmsnorm/dx_without_weight",
         "kernels.flash_attention_torch/lse_missing_max", "moe.capacity/renormalised_gates",
         "moe.router/z_loss_unsquared", "parallel.pipeline/loss_not_scaled")
SELECTED = ("--problem", ",".join(PROBLEMS))


def function_bodies(path: Path) -> dict[str, str]:
    """Each function's body (docstring left out) as a normalised AST dump, by the dump."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            if body:
                found[ast.dump(ast.Module(body=body, type_ignores=[]))] = f"{path.name}:{node.name}"
    return found


def given_bodies() -> set[str]:
    """The bodies of the functions the shipped stubs give, written out (their docstrings start with "Given")."""
    given = set()
    for path in (ROOT / "student_impl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and (ast.get_docstring(node) or "").startswith("Given"):
                given.add(ast.dump(ast.Module(body=node.body[1:], type_ignores=[])))
    return given


def test_the_copy_holds_no_reference_code(students_copy):
    assert {p.name for p in students_copy.iterdir()} == {
        "README.md", "assignment", "expectations", "grader", "handout.pdf", "pyproject.toml", "student_impl"}
    assert not any((students_copy / name).exists() for name in release.INSTRUCTOR_ONLY)
    reference = {}
    for path in (ROOT / "reference").rglob("*.py"):
        reference.update(function_bodies(path))
    for body in given_bodies():
        reference.pop(body, None)  # what the stubs give (grader.checks.stubs) is the students' already
    copied = [(body, where) for path in students_copy.rglob("*.py")
              for body, where in function_bodies(path).items() if body in reference]
    assert not copied, f"reference function bodies in the students' copy: {[(w, reference[b]) for b, w in copied]}"
    for path in (students_copy / "expectations").rglob(f"*{expectations.SUFFIX}"):
        data = expectations.read(path)  # weights_only: a file holding code or a class would not load
        assert set(data) == {"format", "problem", "profile", "versions", "draws", "tests"}


def test_the_copy_pins_what_decides_the_draws(students_copy):
    pyproject = (students_copy / "pyproject.toml").read_text()
    versions = expectations.versions()
    assert f'"torch=={versions["torch"]}"' in pyproject and f'"hypothesis=={versions["hypothesis"]}"' in pyproject
    readme = (students_copy / "README.md").read_text()
    assert f"pip install torch=={versions['torch']} -e ." in readme and "\npytest grader\n" in readme


def test_stubs_are_not_implemented_without_the_reference(students_copy):
    run = run_grader(students_copy / "student_impl", cwd=students_copy)
    assert run.results["tests"] and run.results["score"] == 0
    assert all(t["output"].startswith("not implemented") for t in run.results["tests"]), run.output[-2000:]


def test_a_copy_of_the_reference_gets_full_marks(students_copy, tmp_path):
    impl = shutil.copytree(ROOT / "reference", tmp_path / "solution")
    run = run_grader(impl, *SELECTED, cwd=students_copy)
    graded = [t for t in run.results["tests"] if not t["output"].startswith("skipped")]
    assert graded and all(t["status"] == "passed" for t in graded), run.output[-3000:]
    assert run.results["score"] == pytest.approx(sum(t["max_score"] for t in graded))


def test_wrong_implementations_get_the_live_verdicts(students_copy, tmp_path):
    """Every test of the chosen problems: the same status and points as the live grader gives the same code. The
    failing input shown may differ: shrinking stops at the smallest recorded input that fails."""
    chosen = [mutant for mutant in mutants.discover() if mutant.id in WRONG]
    assert len(chosen) == len(WRONG)
    impl = mutants.materialise(chosen, tmp_path / "wrong")
    with ThreadPoolExecutor(2) as pool:  # one grader run on each of CI's two cores
        live, replayed = pool.map(lambda cwd: run_grader(impl, *SELECTED, cwd=cwd), (ROOT, students_copy))
    verdicts = [{t["name"]: (t.get("status"), t["score"]) for t in run.results["tests"]} for run in (live, replayed)]
    assert verdicts[0] == verdicts[1]
    for mutant in chosen:  # each still fails its named test for its reason
        name = f"{mutant.problem} :: {mutant.test}"
        assert verdicts[1][name][0] == "failed", replayed.output[-3000:]


AUDITED_RUN = textwrap.dedent("""
    import importlib, os, pkgutil, sys
    folders = [os.path.join(root, "reference") for root in sys.argv[1:]]
    opened = []
    sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" and any(
        os.path.abspath(str(args[0])).startswith(folder) for folder in folders) else None)
    import grader, assignment
    for package in (grader, assignment):
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not module.name.startswith("grader.test_"):
                importlib.import_module(module.name)
    import pytest
    status = pytest.main(["grader", "-q", "-p", "no:cacheprovider", "--profile", "ci"])
    print("OPENED", opened)
    sys.exit(0 if status in (0, 1) and not opened else 3)
""")


def test_grading_in_the_copy_opens_nothing_named_reference(students_copy):
    """Neither the repository's reference/ nor one beside the copy: importing every module of the copy, then
    grading the stubs."""
    done = subprocess.run([sys.executable, "-c", AUDITED_RUN, str(ROOT), str(students_copy)], cwd=students_copy,
                          capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_other_draws_are_refused_with_the_versions(tmp_path):
    folder = tmp_path / "ci"
    store = expectations.Store(folder, "record", "ci")
    store.problem("kernels.softmax")["draws"] = "drawn by another torch"
    store.write(["kernels.softmax"])
    with pytest.raises(expectations.DrawsDiffer, match=r"recorded with torch .* Install the recorded versions"):
        expectations.check_draws(folder)


def test_release_refuses_a_folder_in_use_and_uncommitted_reference(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    assert any("not empty" in reason for reason in release.refusals(ROOT, tmp_path / "out", force=False))
    repository = tmp_path / "repository"
    (repository / "reference").mkdir(parents=True)
    (repository / "reference" / "x.py").write_text("A = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "x"]):
        subprocess.run([*git, *command], cwd=repository, check=True)
    assert release.uncommitted(repository) == []
    (repository / "reference" / "x.py").write_text("A = 2\n")
    assert "reference/x.py" in release.uncommitted(repository)[0]
