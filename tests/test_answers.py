"""The analysis problems' answer sheets are read as data (grader.checks.answers): what a sheet may hold, and how each
kind of bad sheet or answer is told."""

from __future__ import annotations

import pytest
import torch

from grader.checks import answers, stubs
from grader.checks.outcomes import NotImplementedByStudent, WrongAnswer
from grader.kernels.speed_cases import SOFTMAX_BESIDE_COPY
from grader.speed.grading import check_sample
from grader.speed.timing import sample


def sheet_file(tmp_path, body: str):
    path = tmp_path / "analysis.py"
    path.write_text(f'"""A sheet."""\n\n{body}\n')
    return path


def test_a_sheet_is_read_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    path = sheet_file(tmp_path, f'open({str(marker)!r}, "w").close()\nANSWERS = {{"a": 1, "b": 2.5, "c": "b"}}')
    assert answers.read_sheet(path) == {"a": 1, "b": 2.5, "c": "b"}
    assert not marker.exists()


@pytest.mark.parametrize("body, words", [
    ('ANSWERS = {"a": 2 * 64}', "written out as a literal"),
    ('ANSWERS = {"a": float("nan")}', "written out as a literal"),
    ("ANSWERS = [1, 2]", "dict from question ids"),
    ("ANSWERS = {1: 2}", "dict from question ids"),
    ("answers = {}", "no top-level"),
    ("ANSWERS = {", "not a readable answer sheet"),
])
def test_a_sheet_that_is_not_data_is_refused_with_the_reason(tmp_path, body, words):
    with pytest.raises(WrongAnswer, match=words):
        answers.read_sheet(sheet_file(tmp_path, body))


def test_a_sheet_too_large_to_be_one_is_refused_before_it_is_parsed(tmp_path):
    path = sheet_file(tmp_path, "ANSWERS = {}\n" + "#" * answers.MAX_SHEET_BYTES)
    with pytest.raises(WrongAnswer, match="larger than"):
        answers.read_sheet(path)


def test_each_answer_is_checked_on_its_own():
    sheet = {"done": 4.0, "skipped": None, "yes": True, "text": "4", "huge": 1e400}
    assert answers.number(sheet, "done") == 4.0
    with pytest.raises(NotImplementedByStudent, match="skipped: not answered"):
        answers.number(sheet, "skipped")
    for key in ("yes", "text", "huge"):
        with pytest.raises(WrongAnswer, match="finite number"):
            answers.number(sheet, key)
    with pytest.raises(WrongAnswer, match="missing"):
        answers.number(sheet, "absent")


def test_a_derived_answer_is_told_how_close_it_must_be_but_not_the_value():
    answers.check_derived({"n": 160}, "n", 160)
    answers.check_derived({"x": 63.1}, "x", 63.015, rel_tol=0.005)
    with pytest.raises(WrongAnswer) as wrong:
        answers.check_derived({"x": 64.0}, "x", 63.015, rel_tol=0.005)
    assert "within 0.5%" in str(wrong.value) and "63.0" not in str(wrong.value)
    with pytest.raises(WrongAnswer, match="exactly"):
        answers.check_derived({"n": 161}, "n", 160)


def test_a_choice_is_one_letter_of_those_offered():
    answers.check_choice({"c": " B "}, "c", "b", "abcd")
    with pytest.raises(WrongAnswer, match="one letter"):
        answers.check_choice({"c": "e"}, "c", "b", "abcd")
    with pytest.raises(WrongAnswer, match="not the right choice"):
        answers.check_choice({"c": "a"}, "c", "b", "abcd")


def test_a_measured_answer_is_compared_with_the_graders_measurement():
    answers.check_measured("f", 0.8, 0.9, 0.25, "timed here")
    with pytest.raises(WrongAnswer, match="the grader measured 0.5"):
        answers.check_measured("f", 0.8, 0.5, 0.25, "timed here")


def test_an_untouched_sheet_is_a_stub_and_one_answer_makes_it_started(tmp_path):
    path = sheet_file(tmp_path, 'ANSWERS = {\n    # a question\n    "a": None,\n    "b": None,\n}')
    assert stubs.all_stubs(path)
    path.write_text(path.read_text().replace('"a": None', '"a": 3'))
    assert not stubs.all_stubs(path)


def test_the_copy_fraction_checks_each_timed_softmax_against_a_true_one():
    """The measured softmax runs beside a clone, whose output is not a softmax: the timed outputs are checked against
    the spec's oracle instead, which a right softmax passes and a wrong one fails."""
    args = SOFTMAX_BESIDE_COPY.inputs((8, 300), "float32", seed=3, device=torch.device("cpu"))
    right = torch.softmax(args[0], dim=-1)
    for seed in range(3):
        expected = SOFTMAX_BESIDE_COPY.expected_sample(args, SOFTMAX_BESIDE_COPY.baseline(*args), seed)
        check_sample(sample(right, seed), expected, torch.float32, "softmax")
        with pytest.raises(WrongAnswer, match="differs from the expected one"):
            check_sample(sample(right * 1.001, seed), expected, torch.float32, "softmax")
