"""Grading attention.linear_attention: causal linear attention with phi = elu + 1 and no normaliser, in three forms:
the masked quadratic (parallel) form and the recurrent form in PyTorch, and the chunked form in Triton (forward in
Triton; backward in Triton or chunked PyTorch).

Every form is measured against the recurrence at float64 in the grader (grader.attention.linear_cases), the
reference's chunked form at the input dtype setting the tolerance. bfloat16 is graded on a GPU only.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.attention import linear_checks as checks
from grader.attention.linear_cases import (
    LINEAR_ATTENTION,
    check_raises,
    invalid_arguments,
    linear_cases,
    worked_example,
)
from grader.attention.speed_cases import SPEEDS
from grader.checks.marks import bf16_gpu_only, drawn_dtypes, gpu_only
from grader.checks.profiles import examples
from grader.speed.grading import grade_speed

PROBLEM = BY_ID["attention.linear_attention"]
# Graded in every profile: every feature at once (views of [batch, seq, heads, dim], T past two chunks and not a
# multiple of C, K != V, gates and an initial state where the problem has them).
WORKED = worked_example(LINEAR_ATTENTION)
DTYPES = drawn_dtypes(torch.float32, torch.float16)


@examples(PROBLEM)
@example(case=WORKED)
@given(case=linear_cases(LINEAR_ATTENTION, DTYPES))
def test_parallel_form(student, reference, case):
    checks.check_form(student, reference, PROBLEM, case, "parallel")


@examples(PROBLEM)
@example(case=WORKED)
@given(case=linear_cases(LINEAR_ATTENTION, DTYPES))
def test_recurrent_form(student, reference, case):
    checks.check_form(student, reference, PROBLEM, case, "recurrent")


@examples(PROBLEM)
@example(case=WORKED)
@given(case=linear_cases(LINEAR_ATTENTION, (torch.float32,)))
def test_chunked_fp32(student, reference, case):
    checks.check_form(student, reference, PROBLEM, case, "chunked")


@examples(PROBLEM)
@given(case=linear_cases(LINEAR_ATTENTION, (torch.float16,)))
def test_chunked_fp16(student, reference, case):
    checks.check_form(student, reference, PROBLEM, case, "chunked")


@bf16_gpu_only
@examples(PROBLEM)
@given(case=linear_cases(LINEAR_ATTENTION, (torch.bfloat16,)))
def test_chunked_bf16(student, reference, case):
    checks.check_form(student, reference, PROBLEM, case, "chunked")


@examples(PROBLEM)
@example(case=WORKED)
@given(case=linear_cases(LINEAR_ATTENTION, DTYPES))
def test_backward(student, reference, case):
    """dq, dk and dv of the chunked form, phi's derivative included."""
    checks.check_backward(student, reference, PROBLEM, case)


@examples(PROBLEM, 0.5)
@example(case=WORKED)
@given(case=linear_cases(LINEAR_ATTENTION, DTYPES))
def test_forms_agree(student, reference, case):
    checks.check_forms_agree(student, reference, PROBLEM, case)


@examples(PROBLEM, 0.5)
@given(case=linear_cases(LINEAR_ATTENTION, DTYPES, seq=st.integers(129, 160), head_dims=st.just(16),
                         chunk_size=st.just(16)))
def test_memory_discipline(student, case):
    """Forward and backward of the chunked form: no T x T tensor, no state per step, no block longer than 128."""
    checks.check_memory_discipline(student, PROBLEM, case)


@pytest.mark.parametrize("fault, changes, expected_error", invalid_arguments(LINEAR_ATTENTION),
                         ids=[fault for fault, _, _ in invalid_arguments(LINEAR_ATTENTION)])
def test_invalid_arguments(student, fault, changes, expected_error):
    check_raises(student, LINEAR_ATTENTION, fault, changes, expected_error)


@gpu_only
@pytest.mark.parametrize("case", PROBLEM.speed.cases(), ids=str)
def test_speed(student, reference, partial_credit, case):
    grade_speed(SPEEDS[PROBLEM.id], student, reference, case, PROBLEM.speed, partial_credit)
