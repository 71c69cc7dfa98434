"""Grading kernels.flash_attention_triton: FlashAttention-2's forward and backward as Triton kernels.

Outputs and gradients are measured against attention written out in full at float64, with the reference kernels'
own error at the input dtype as the yardstick. The logsumexp L and the tensors saved for backward are read off the
autograd node of FlashAttentionFunction by grader.kernels.attention_cases.probe, which runs inside the worker and also
records the Triton kernels launched by the forward and by the backward. bfloat16 is graded on a GPU only.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.marks import bf16_gpu_only, drawn_dtypes, gpu_only
from grader.checks.profiles import examples
from grader.checks.strategies import size_scale
from grader.kernels.attention_cases import (
    INVALID,
    PADDED_HEAD_DIM,
    TRITON_MAX_BLOCK,
    call_and_expect,
    check_blocks_bounded,
    check_gradients,
    check_lse,
    check_no_score_matrix,
    check_output,
    check_raises,
    probe_and_expect,
    run_probe,
)
from grader.kernels.attention_cases import (
    attention_cases as cases,
)
from grader.kernels.speed_cases import SPEEDS
from grader.speed.grading import grade_speed

PROBLEM = BY_ID["kernels.flash_attention_triton"]
# Triton's interpreter computes bfloat16 arithmetic wrongly: bfloat16 joins the mixed-dtype tests on a GPU only.
DTYPES = drawn_dtypes(torch.float32, torch.float16)
TOLERANCE = dict(error_multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps)


def check_forward(student, reference, case) -> None:
    q, k, v, _ = case.inputs()
    actual, want = call_and_expect(student, reference, case, q, k, v)
    check_output(actual, want, **TOLERANCE, context=case.describe())


@examples(PROBLEM)
@example(case=PADDED_HEAD_DIM)
@given(case=cases((torch.float32,), causal=st.just(False)))
def test_forward_fp32(student, reference, case):
    check_forward(student, reference, case)


@examples(PROBLEM)
@given(case=cases((torch.float16,), causal=st.just(False)))
def test_forward_fp16(student, reference, case):
    check_forward(student, reference, case)


@bf16_gpu_only
@examples(PROBLEM)
@given(case=cases((torch.bfloat16,), causal=st.just(False)))
def test_forward_bf16(student, reference, case):
    check_forward(student, reference, case)


@examples(PROBLEM)
@example(case=PADDED_HEAD_DIM)
@given(case=cases(DTYPES))
def test_logsumexp(student, reference, case):
    """L = log sum_j exp(S_ij), the fifth tensor of ctx.save_for_backward(q, k, v, o, L)."""
    q, k, v, _ = case.inputs()
    report, want = probe_and_expect(student, reference, case, q, k, v, uses_triton=True)
    check_lse(report, want, **TOLERANCE, context=case.describe())


@examples(PROBLEM)
@example(case=PADDED_HEAD_DIM)
@given(case=cases(DTYPES, causal=st.just(False)))
def test_backward(student, reference, case):
    q, k, v, grad_o = case.inputs()
    report, want = probe_and_expect(student, reference, case, q, k, v, grad_o, uses_triton=True)
    check_gradients(report, want, **TOLERANCE, context=case.describe())


@examples(PROBLEM)
@given(case=cases(DTYPES, causal=st.just(True)))
def test_causal(student, reference, case):
    """Query i attends key j iff j <= i: the output and all three gradients."""
    q, k, v, grad_o = case.inputs()
    report, want = probe_and_expect(student, reference, case, q, k, v, grad_o, uses_triton=True)
    check_output(report["output"], want, **TOLERANCE, context=case.describe())
    check_gradients(report, want, **TOLERANCE, context=case.describe())


@examples(PROBLEM, 0.5)
@given(case=cases(DTYPES, seq=st.integers(33, 40 * size_scale()), head_dim=st.just(16)))
def test_saves_no_score_matrix(student, case):
    """Forward and backward: exactly (q, k, v, o, L) saved, and no tensor with two dimensions of length seq built.

    seq > 32 exceeds head_dim and every other dimension, so only an n x n matrix has two dimensions of that length.
    """
    q, k, v, grad_o = case.inputs()
    report = run_probe(student, case, q, k, v, grad_o, uses_triton=True)
    check_no_score_matrix(report, case.seq, case.describe())


@examples(PROBLEM, 0.25)
@given(case=cases(DTYPES, seq=st.integers(TRITON_MAX_BLOCK + 1, TRITON_MAX_BLOCK + 72), head_dim=st.just(16),
                  max_pairs=1))
def test_blocks_bounded(student, case):
    """Forward and backward on a sequence longer than TRITON_MAX_BLOCK: no block of two or more dimensions in any
    kernel is longer than that along a dimension. The blocks come from the interpreter's tensors on a CPU and from
    each compiled kernel's Triton IR on a GPU (grader.sandbox.triton_traffic)."""
    q, k, v, grad_o = case.inputs()
    report = run_probe(student, case, q, k, v, grad_o, uses_triton=True)
    check_blocks_bounded(report, case.seq, case.describe())


@pytest.mark.parametrize("make_inputs, expected_error", INVALID)
def test_invalid_arguments(student, make_inputs, expected_error):
    check_raises(student, make_inputs, expected_error)


@gpu_only
@pytest.mark.parametrize("case", PROBLEM.speed.cases(), ids=str)
def test_speed(student, reference, partial_credit, case):
    grade_speed(SPEEDS[PROBLEM.id], student, reference, case, PROBLEM.speed, partial_credit)

