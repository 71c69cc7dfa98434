"""Grading kernels.flash_attention_torch: FlashAttention-2's forward and backward as PyTorch loops over tiles.

Outputs and gradients are measured against attention written out in full at float64, with the reference's own error
at the input dtype as the yardstick. The logsumexp L and the tensors saved for backward are read off the autograd
node of FlashAttentionFunction by grader.kernels.attention_cases.probe, which runs inside the worker.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.profiles import examples
from grader.checks.strategies import size_scale
from grader.kernels.attention_cases import (
    INVALID,
    PADDED_HEAD_DIM,
    call_and_expect,
    check_gradients,
    check_lse,
    check_no_score_matrix,
    check_output,
    check_raises,
    probe_and_expect,
    run_probe,
    sequence_lengths,
)
from grader.kernels.attention_cases import (
    attention_cases as cases,
)

PROBLEM = BY_ID["kernels.flash_attention_torch"]
# Plain PyTorch runs bfloat16 correctly on the CPU too.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOLERANCE = dict(error_multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps)
# Python loops launch a few kernels for each of the (seq / 16)^2 pairs of tiles: sequences stay at 160 or less (10
# tiles) even on a GPU, so that a correct student's loops fit the time limits.
MAX_SEQ = 40 * min(size_scale(), 4)
SEQ = sequence_lengths(MAX_SEQ)


@examples(PROBLEM)
@example(case=PADDED_HEAD_DIM)
@given(case=cases(DTYPES, causal=st.just(False), seq=SEQ))
def test_forward(student, reference, case):
    q, k, v, _ = case.inputs()
    actual, want = call_and_expect(student, reference, case, q, k, v)
    check_output(actual, want, **TOLERANCE, context=case.describe())


@examples(PROBLEM)
@example(case=PADDED_HEAD_DIM)
@given(case=cases(DTYPES, seq=SEQ))
def test_logsumexp(student, reference, case):
    """L = log sum_j exp(S_ij), the fifth tensor of ctx.save_for_backward(q, k, v, o, L)."""
    q, k, v, _ = case.inputs()
    report, want = probe_and_expect(student, reference, case, q, k, v)
    check_lse(report, want, **TOLERANCE, context=case.describe())


@examples(PROBLEM)
@example(case=PADDED_HEAD_DIM)
@given(case=cases(DTYPES, causal=st.just(False), seq=SEQ))
def test_backward(student, reference, case):
    q, k, v, grad_o = case.inputs()
    report, want = probe_and_expect(student, reference, case, q, k, v, grad_o)
    check_gradients(report, want, **TOLERANCE, context=case.describe())


@examples(PROBLEM)
@given(case=cases(DTYPES, causal=st.just(True), seq=SEQ))
def test_causal(student, reference, case):
    """Query i attends key j iff j <= i: the output and all three gradients."""
    q, k, v, grad_o = case.inputs()
    report, want = probe_and_expect(student, reference, case, q, k, v, grad_o)
    check_output(report["output"], want, **TOLERANCE, context=case.describe())
    check_gradients(report, want, **TOLERANCE, context=case.describe())


@examples(PROBLEM, 0.5)
@given(case=cases(DTYPES, seq=st.integers(33, MAX_SEQ), head_dim=st.just(32)))
def test_saves_no_score_matrix(student, case):
    """Forward and backward: exactly (q, k, v, o, L) saved, and no tensor built with two dimensions of length seq,
    nor with one of length seq beside one of TILE_SIZE.

    seq > 32 exceeds head_dim and every other dimension, so only an n x n matrix has two dimensions of that length;
    head_dim 32 (and batch and heads other than 16, as the draws under ci always are) leaves TILE_SIZE to the tiles,
    so a dimension of 16 beside one of seq is a tile of queries against every key (or of keys against every query).
    """
    q, k, v, grad_o = case.inputs()
    report = run_probe(student, case, q, k, v, grad_o)
    check_no_score_matrix(report, case.seq, case.describe())


@pytest.mark.parametrize("make_inputs, expected_error", INVALID)
def test_invalid_arguments(student, make_inputs, expected_error):
    check_raises(student, make_inputs, expected_error)
