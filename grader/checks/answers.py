"""The analysis problems' answer sheets: `ANSWERS = {...}` in student_impl/<family>/analysis.py, read as data.

A sheet is data, not code: the grader takes the dict literal assigned to ANSWERS from the file's syntax tree, in its
own process, and never imports the module. So an answer can be a number or a choice's letter written out, never a
computation, and reading it cannot run student code. An answer left as None is "not answered": that question alone
shows "not implemented"; a sheet whose every answer is None is the untouched stub.

Each question is one test group. A derived answer is compared with the grader's own derivation; a measured one with
the grader's measurement of the student's code on the same GPU, or, on a machine without one, checked for consistency
only (the test's note says which).
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import torch

from assignment.sheet_syntax import SHEET_VARIABLE, sheet_assignment
from grader.checks.outcomes import NotImplementedByStudent, WrongAnswer

# A sheet is a few dozen short lines; a larger file is refused before it is parsed.
MAX_SHEET_BYTES = 64 * 1024
# How far a measured answer may lie from the grader's own measurement on the same GPU.
MEASURED_REL_TOL = 0.25


class SheetError(ValueError):
    """The file is not a sheet the grader can read; the message says why."""


def literal_answers(source: str) -> dict[str, object]:
    """The dict literal the source assigns to ANSWERS at top level (the last such assignment)."""
    found = sheet_assignment(ast.parse(source))
    if found is None:
        raise SheetError(f"no top-level `{SHEET_VARIABLE} = {{...}}` assignment")
    try:
        answers = ast.literal_eval(found.value)
    except ValueError:
        raise SheetError(f"{SHEET_VARIABLE} must be a dict written out as a literal (numbers, strings, None): the "
                         "grader reads the file without running it, so an expression is not evaluated") from None
    if not isinstance(answers, dict) or not all(isinstance(key, str) for key in answers):
        raise SheetError(f"{SHEET_VARIABLE} must be a dict from question ids (strings) to answers")
    return answers


def unanswered(source: str) -> bool:
    """Whether the source is a sheet with every answer still None (the stub of an analysis problem)."""
    try:
        answers = literal_answers(source)
    except (SheetError, SyntaxError, ValueError):
        return False
    return bool(answers) and all(value is None for value in answers.values())


def read_sheet(path: Path) -> dict[str, object]:
    """The answers of the sheet at `path`; WrongAnswer says why a file is not a readable sheet."""
    try:
        if path.stat().st_size > MAX_SHEET_BYTES:
            raise SheetError(f"the file is larger than {MAX_SHEET_BYTES // 1024} KiB")
        return literal_answers(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, SheetError) as error:
        raise WrongAnswer(f"{path.name} is not a readable answer sheet: {error}") from None


def answer(sheet: dict[str, object], key: str) -> object:
    if key not in sheet:
        raise WrongAnswer(f"{key}: missing from {SHEET_VARIABLE} (keep every key of the stub)")
    if sheet[key] is None:
        raise NotImplementedByStudent(f"{key}: not answered")
    return sheet[key]


def number(sheet: dict[str, object], key: str) -> float:
    """The answer to `key` as a finite float (an int or a float on the sheet; bool is not a number here)."""
    value = answer(sheet, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise WrongAnswer(f"{key}: the answer must be a finite number, not {value!r:.60}")
    return float(value)


def check_derived(sheet: dict[str, object], key: str, expected: float, rel_tol: float = 0.0) -> None:
    """A derived answer: exactly `expected` (rel_tol 0, for counts), or within rel_tol of it. The message does not
    give the expected value away; it says how close the answer must be."""
    value = number(sheet, key)
    if not math.isclose(value, expected, rel_tol=rel_tol, abs_tol=0.0):
        how = "exactly" if rel_tol == 0 else f"within {rel_tol:.1%} of"
        raise WrongAnswer(f"{key}: {value:g} is wrong: it must be {how} the value the grader derives from the "
                          "question's numbers")


def check_choice(sheet: dict[str, object], key: str, expected: str, choices: str) -> None:
    value = answer(sheet, key)
    if not isinstance(value, str) or len(value.strip()) != 1 or value.strip().lower() not in choices:
        raise WrongAnswer(f"{key}: answer with one letter of {', '.join(choices)}, not {value!r:.60}")
    if value.strip().lower() != expected:
        raise WrongAnswer(f"{key}: {value.strip().lower()!r} is not the right choice")


def check_measured(key: str, value: float, measured: float, rel_tol: float, how: str) -> None:
    """A measured answer against the grader's own measurement on the same machine (`how` says what it timed)."""
    if not abs(value - measured) <= rel_tol * abs(measured):
        raise WrongAnswer(f"{key}: you wrote {value:.3g}, the grader measured {measured:.3g} ({how}); the answer must "
                          f"be within {rel_tol:.0%} of the grader's measurement")


def measurable_here(partial_credit, task: str) -> bool:
    """Whether there is a GPU here for a measured answer's measurement (`task`, what it would do). Without one, the
    consistency checks made before are all there can be, and the score table notes it."""
    if torch.cuda.is_available():
        return True
    partial_credit(1.0, f"consistency only: no GPU here to {task}")
    return False


def check_baseline_over_kernel(key: str, value: float, spec, kernel, case: tuple, how: str, partial_credit,
                               what: str) -> None:
    """A measured answer that is the baseline's time over the student's `kernel` (a worker of its problem), as
    `spec` times them on `case`: on a GPU, compared with the grader's own timing within MEASURED_REL_TOL; without
    one, only noted (measurable_here)."""
    if not measurable_here(partial_credit, f"measure your {what} on"):
        return
    medians = spec.against_baseline(kernel, case)
    check_measured(key, value, medians["baseline"] / medians["student"], MEASURED_REL_TOL, how)
