"""Grading attention.mamba2: scalar-gated linear attention, its recurrent form in PyTorch and its chunked form in
Triton (forward in Triton; backward in Triton or chunked PyTorch), with an initial state in and the final state out.

Every form is measured against the recurrence at float64 in the grader (grader.attention.linear_cases), the
reference's chunked form at the input dtype setting the tolerance. bfloat16 is graded on a GPU only.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.attention import linear_checks as checks
from grader.attention.linear_cases import MAMBA2, check_raises, invalid_arguments, linear_cases, worked_example
from grader.attention.speed_cases import SPEEDS
from grader.checks.marks import bf16_gpu_only, drawn_dtypes, gpu_only
from grader.checks.profiles import examples
from grader.checks.strategies import size_scale
from grader.speed.grading import grade_speed

PROBLEM = BY_ID["attention.mamba2"]
# Graded in every profile: every feature at once (views of [batch, seq, heads, dim], T past two chunks and not a
# multiple of C, K != V, gates and an initial state where the problem has them).
WORKED = worked_example(MAMBA2)
# Only the final state used downstream: o's gradient reaches the backward as None (or zeros).
STATE_ONLY_UPSTREAM = replace(WORKED, upstream="state")
DTYPES = drawn_dtypes(torch.float32, torch.float16)


@examples(PROBLEM)
@example(case=WORKED)
@given(case=linear_cases(MAMBA2, DTYPES))
def test_recurrent_form(student, reference, case):
    checks.check_form(student, reference, PROBLEM, case, "recurrent")


@examples(PROBLEM)
@example(case=WORKED)
@given(case=linear_cases(MAMBA2, (torch.float32,)))
def test_chunked_fp32(student, reference, case):
    checks.check_form(student, reference, PROBLEM, case, "chunked")


@examples(PROBLEM)
@given(case=linear_cases(MAMBA2, (torch.float16,)))
def test_chunked_fp16(student, reference, case):
    checks.check_form(student, reference, PROBLEM, case, "chunked")


@bf16_gpu_only
@examples(PROBLEM)
@given(case=linear_cases(MAMBA2, (torch.bfloat16,)))
def test_chunked_bf16(student, reference, case):
    checks.check_form(student, reference, PROBLEM, case, "chunked")


@examples(PROBLEM)
@example(case=WORKED)
@example(case=STATE_ONLY_UPSTREAM)
@given(case=linear_cases(MAMBA2, DTYPES))
def test_backward(student, reference, case):
    """dq, dk, dv, dg and the initial state's gradient, from upstream gradients on o and on the final state."""
    checks.check_backward(student, reference, PROBLEM, case)


@examples(PROBLEM, 0.5)
@example(case=WORKED)
@given(case=linear_cases(MAMBA2, DTYPES))
def test_forms_agree(student, reference, case):
    checks.check_forms_agree(student, reference, PROBLEM, case)


@examples(PROBLEM, 0.5)
@given(case=linear_cases(MAMBA2, DTYPES, seq=st.integers(300, 400 * size_scale()), decay=st.just("strong"),
                         head_dims=st.just(16), initial_state=st.just(False)))
def test_stability(student, reference, case):
    """Log-decays of -5 and below over hundreds of tokens (thousands on a GPU): the decay over one chunk underflows
    float32 unless the chunk is computed in log space."""
    checks.check_form(student, reference, PROBLEM, case, "chunked")


@examples(PROBLEM, 0.5)
@given(case=linear_cases(MAMBA2, DTYPES, seq=st.integers(2, 40 * size_scale())), data=st.data())
def test_state_handoff(student, reference, case, data):
    checks.check_state_handoff(student, reference, PROBLEM, case, data.draw(st.integers(1, case.seq - 1)))


@examples(PROBLEM, 0.5)
@given(case=linear_cases(MAMBA2, DTYPES, seq=st.integers(129, 160), head_dims=st.just(16), chunk_size=st.just(16)))
def test_memory_discipline(student, case):
    """Forward and backward of the chunked form: no T x T tensor, no state per step, no block longer than 128."""
    checks.check_memory_discipline(student, PROBLEM, case)


@pytest.mark.parametrize("fault, changes, expected_error", invalid_arguments(MAMBA2),
                         ids=[fault for fault, _, _ in invalid_arguments(MAMBA2)])
def test_invalid_arguments(student, fault, changes, expected_error):
    check_raises(student, MAMBA2, fault, changes, expected_error)


@gpu_only
@pytest.mark.parametrize("case", PROBLEM.speed.cases(), ids=str)
def test_speed(student, reference, partial_credit, case):
    grade_speed(SPEEDS[PROBLEM.id], student, reference, case, PROBLEM.speed, partial_credit)
