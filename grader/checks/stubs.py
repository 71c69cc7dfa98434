"""Which of a student module's functions are still the stub, read from its source without running it.

A stub function's body is its docstring and `raise NotImplementedError`. Calling one can only raise, so the grader
marks every test that needs it "not implemented" without starting a worker or launching ranks: untouched stubs are
graded in seconds. Reading the source is evidence from outside the student's process; the worst a misleading file
can do is lose its own points (a function that looks like a stub is graded as one).

A stub may also give code that is not the lesson (constructors that pin parameter names, say): such a function's
docstring starts with "Given", and a module of stubs and given functions is still untouched.
"""

from __future__ import annotations

import ast
from pathlib import Path

from grader.checks.answers import unanswered


def _is_docstring(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) and isinstance(
        statement.value.value, str
    )


def _raises_not_implemented(statement: ast.stmt) -> bool:
    if not isinstance(statement, ast.Raise) or statement.exc is None:
        return False
    raised = statement.exc.func if isinstance(statement.exc, ast.Call) else statement.exc
    return isinstance(raised, ast.Name) and raised.id == "NotImplementedError"


def _is_stub(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = [statement for statement in function.body if not _is_docstring(statement)]
    return len(body) == 1 and _raises_not_implemented(body[0])


def _kind(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    if _is_stub(function):
        return "stub"
    docstring = ast.get_docstring(function)
    return "given" if docstring is not None and docstring.startswith("Given") else "written"


def functions(source: str) -> dict[str, str]:
    """Every top-level function and method of a top-level class (`Class.method`), and whether it is a "stub", code
    the stub "given", or "written"."""
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = _kind(node)
        elif isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}.{member.name}"] = _kind(member)
    return found


def stub_functions(module_file: Path) -> frozenset[str]:
    """The names of the module's stub functions (empty when the file does not parse: importing it will say why)."""
    try:
        return frozenset(name for name, kind in functions(module_file.read_text()).items() if kind == "stub")
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return frozenset()


def all_stubs(module_file: Path) -> bool:
    """Whether the module defines stubs and every function is a stub or given, or is an answer sheet with no answer
    yet (grader.checks.answers): nothing of the problem is done yet."""
    try:
        source = module_file.read_text()
        found = functions(source)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return False
    if not found:
        return unanswered(source)
    return "stub" in found.values() and set(found.values()) <= {"stub", "given"}
