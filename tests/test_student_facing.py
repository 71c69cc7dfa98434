"""What a student reads about tests the grader could not give a verdict on here: a problem that the stored
expectations lack, and dtypes drawn on a GPU only."""

from __future__ import annotations

import importlib
import types

import torch

from assignment.registry import BY_ID
from grader.checks.marks import drawn_dtypes, dtypes_drawn_on_gpu_only
from grader.session import scoring
from grader.session.report import score_table
from tests.grading import ROOT, run_grader


def test_a_problem_the_stored_expectations_lack_is_not_graded_in_every_test(tmp_path):
    """As in a students' copy released with --problems, for a problem left out of it: every test of it is "not
    graded" with the reason, none a grader error, and the tests this machine skips stay skipped."""
    (tmp_path / "ci").mkdir()
    run = run_grader(ROOT / "reference", "--problem", "kernels.gelu", "--expectations", str(tmp_path))
    tests = run.tests_of("kernels.gelu")
    graded = [t for t in tests if not t["output"].startswith("skipped")]
    assert len(graded) > 1 and len(graded) < len(tests), run.output[-3000:]
    for test in graded:
        assert test["output"].startswith("not graded: the stored expectations in"), test
        assert "hold none for kernels.gelu" in test["output"] and "graded on submission" in test["output"], test
    assert "grader error" not in run.output


def test_dtypes_drawn_on_a_gpu_only_are_read_from_the_test_module():
    module = types.ModuleType("test_x")
    module.DTYPES = drawn_dtypes(torch.float32)
    module.EXTREME = drawn_dtypes(torch.float16, gpu_only=(torch.bfloat16, torch.float8_e4m3fn))
    module.SIZE = (torch.float32,)
    assert dtypes_drawn_on_gpu_only(module) == ("bfloat16", "float8_e4m3fn")
    assert tuple(module.DTYPES) == ((torch.float32, torch.bfloat16) if torch.cuda.is_available() else (torch.float32,))
    assert dtypes_drawn_on_gpu_only(importlib.import_module("grader.attention.test_mla")) == ("bfloat16",)
    assert dtypes_drawn_on_gpu_only(importlib.import_module("grader.moe.test_router")) == ()


def test_the_score_table_says_which_dtypes_are_graded_on_submission():
    results = [scoring.TestResult("grader/kernels/test_gelu.py::test_matches_reference_fp32", BY_ID["kernels.gelu"],
                          "matches_reference_fp32", 2.0)]
    lines = score_table(scoring.by_problem(results), "", {"kernels.gelu": ("bfloat16",)})
    assert ("graded on submission: kernels.gelu, bfloat16 inputs: drawn on a GPU only (the tests graded here drew "
            "its other dtypes)") in lines
    assert not any("graded on submission" in line for line in score_table(scoring.by_problem(results), "", {}))
