"""Where an answer sheet's answers are in its syntax tree: the last top-level assignment to ANSWERS, plain or
annotated, as Python would leave it. The grader reads the answers from it (grader.checks.answers) and the handout's
build prints it (assignment.handout.build); this module imports nothing else, so the build stays free of torch. It
lives in assignment/ and not in grader/ because the build imports it, and assignment/ imports no grader module."""

from __future__ import annotations

import ast

SHEET_VARIABLE = "ANSWERS"


def sheet_assignment(module: ast.Module) -> ast.Assign | ast.AnnAssign | None:
    """The module's last top-level `ANSWERS = ...` or `ANSWERS: ... = ...`; None if there is none."""
    found = None
    for node in module.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        if any(isinstance(target, ast.Name) and target.id == SHEET_VARIABLE for target in targets):
            found = node
    return found
