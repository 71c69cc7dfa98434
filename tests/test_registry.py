"""Every registered problem is complete: stub, reference, grader module, handout section, points for each test."""

from __future__ import annotations

import ast
import importlib
import json

import pytest

from assignment.new_problem import LANES_FILE, UNFILLED
from assignment.registry import PROBLEMS, ROOT, problem_for_test_module
from grader.checks import marks
from grader.checks.answers import SheetError, literal_answers


def answer_sheet(path) -> dict | None:
    """The answers of an analysis problem's sheet (grader.checks.answers), or None for a module of functions."""
    try:
        return literal_answers(path.read_text())
    except SheetError:
        return None


def public_signatures(path) -> dict[str, str]:
    """name -> argument list, for public functions, classes and their public methods (and __init__); an answer
    sheet's question ids, in order."""
    tree = ast.parse(path.read_text())
    sheet = answer_sheet(path)
    signatures = {} if sheet is None else {"ANSWERS": ", ".join(sheet)}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            signatures[node.name] = ast.unparse(node.args)
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            signatures[node.name] = ""
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and (not item.name.startswith("_") or item.name == "__init__"):
                    signatures[f"{node.name}.{item.name}"] = ast.unparse(item.args)
                if isinstance(item, ast.AnnAssign):
                    signatures[f"{node.name}.{ast.unparse(item.target)}"] = ast.unparse(item.annotation)
    return signatures


def grader_test_groups(problem) -> set[str]:
    """The points groups of a problem's test module: each test function's, or the groups it is marked with."""
    module = importlib.import_module(problem.test_module.removesuffix(".py").replace("/", "."))
    return {group for name, function in vars(module).items() if name.startswith("test_") and callable(function)
            for group in marks.groups_of_function(function)}


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.id)
def test_problem_has_its_five_places(problem):
    assert (ROOT / "student_impl" / problem.module_path).exists()
    assert (ROOT / "reference" / problem.module_path).exists()
    assert (ROOT / problem.test_module).exists()
    assert problem.handout_section.exists()
    assert problem_for_test_module(f"grader.{problem.family}.test_{problem.name}") is problem


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.id)
def test_no_place_is_left_unfilled(problem):
    """`python -m assignment new-problem` writes UNFILLED wherever a person must write; each place still holding it
    is named here, and lane seconds still estimated are named too."""
    places = {"student_impl": ROOT / "student_impl" / problem.module_path,
              "reference": ROOT / "reference" / problem.module_path,
              "grader module": ROOT / problem.test_module, "handout section": problem.handout_section}
    unfilled = [f"{place} ({path.relative_to(ROOT)})" for place, path in places.items() if UNFILLED in path.read_text()]
    entry = [problem.title, problem.learns, *problem.evidence.values()]
    unfilled += ["registry entry (assignment/registry.py)"] if any(UNFILLED in text for text in entry) else []
    estimated = json.loads((ROOT / LANES_FILE).read_text()).get("estimated", [])
    unfilled += [f"lane seconds, estimated ({LANES_FILE}: measure with benchmarks/grading_time.py)"] * (
        problem.id in estimated)
    assert not unfilled, f"{problem.id} is not filled in yet: " + "; ".join(unfilled)


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.id)
def test_problem_says_what_it_teaches_and_how_long_it_takes(problem):
    assert problem.hours is not None and problem.hours > 0, (
        f"{problem.id}: give its entry `hours`, about how many hours the problem takes (the handout prints it)")
    assert problem.learns.strip(), (
        f'{problem.id}: give its entry `learns`, what the student learns, a phrase that follows "You learn"')


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.id)
def test_points_match_test_functions(problem):
    assert set(problem.points) == grader_test_groups(problem)
    assert all(points > 0 for points in problem.points.values())
    assert set(problem.budgets) == {"ci", "public", "grading"}


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.id)
def test_stub_and_reference_share_signatures(problem):
    stub = public_signatures(ROOT / "student_impl" / problem.module_path)
    reference = public_signatures(ROOT / "reference" / problem.module_path)
    assert stub, f"the stub of {problem.id} defines nothing public"
    for name, signature in stub.items():
        assert reference.get(name) == signature, f"{problem.id}: {name} differs between stub and reference"


def functions_by_name(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """Module-level functions and the methods of module-level classes, by name (`Class.method` for methods)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        if isinstance(node, ast.ClassDef):
            found.update({f"{node.name}.{item.name}": item for item in node.body if isinstance(item, ast.FunctionDef)})
    return found


def code_without_docstring(function: ast.FunctionDef) -> str:
    body = function.body
    if ast.get_docstring(function) is not None:
        body = body[1:]
    return ast.dump(ast.Module(body=body, type_ignores=[]))


SHEETS = [p for p in PROBLEMS if answer_sheet(ROOT / "student_impl" / p.module_path) is not None]


@pytest.mark.parametrize("problem", SHEETS, ids=lambda p: p.id)
def test_an_answer_sheet_stub_answers_nothing_and_the_reference_everything(problem):
    stub = answer_sheet(ROOT / "student_impl" / problem.module_path)
    reference = answer_sheet(ROOT / "reference" / problem.module_path)
    assert stub and all(value is None for value in stub.values()), f"{problem.id}: the stub gives an answer away"
    assert all(value is not None for value in reference.values()), f"{problem.id}: the reference leaves one out"


@pytest.mark.parametrize("problem", [p for p in PROBLEMS if p not in SHEETS], ids=lambda p: p.id)
def test_stub_bodies_raise_not_implemented(problem):
    """Every public function of a stub (and every __init__) raises NotImplementedError, unless the stub gives it: its
    docstring then starts with "Given" (grader.checks.stubs) and its code is the reference's own, docstring aside
    (plumbing such as constructors that pin parameter names)."""
    tree = ast.parse((ROOT / "student_impl" / problem.module_path).read_text())
    reference = functions_by_name(ast.parse((ROOT / "reference" / problem.module_path).read_text()))
    functions = {name: node for name, node in functions_by_name(tree).items()
                 if not name.rpartition(".")[2].startswith("_") or name.endswith("__init__")}
    assert functions
    assert any(isinstance(node.body[-1], ast.Raise) for node in functions.values()), "the stub leaves nothing to write"
    for name, function in functions.items():
        assert ast.get_docstring(function) or ast.get_docstring(tree), f"{name} has no contract"
        last = function.body[-1]
        if isinstance(last, ast.Raise) and "NotImplementedError" in ast.unparse(last):
            continue
        assert (ast.get_docstring(function) or "").startswith("Given"), f"{name} is given without saying so"
        assert name in reference and code_without_docstring(function) == code_without_docstring(reference[name]), (
            f"{name} neither raises NotImplementedError nor is the reference's code")


@pytest.mark.parametrize("problem", [p for p in PROBLEMS if p.family == "parallel"], ids=lambda p: p.id)
def test_every_parallel_test_says_what_its_points_rest_on(problem):
    """The handout's grading table states, for every parallel test group, whether its evidence is verified from
    outside the student's processes or recorded inside them."""
    assert set(problem.evidence) == set(problem.points), problem.id
    for group, evidence in problem.evidence.items():
        assert evidence.startswith(("outside:", "in-process:")), (group, evidence)


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.id)
def test_teaching_order_follows_what_each_problem_builds_on(problem):
    """Every problem a problem builds on exists and comes before it in PROBLEMS (the handout's chapter order and its
    map of the problems), and none builds on itself."""
    order = [p.id for p in PROBLEMS]
    assert problem.id not in problem.builds_on, f"{problem.id} builds on itself"
    assert len(set(problem.builds_on)) == len(problem.builds_on), f"{problem.id} names a problem twice"
    for earlier in problem.builds_on:
        assert earlier in order, f"{problem.id} builds on {earlier}, which is not a registered problem"
        assert order.index(earlier) < order.index(problem.id), f"{problem.id} builds on {earlier}, taught after it"
