"""Grading attention.sliding_window: causal attention over the last `window` keys, forward and backward in Triton.

Outputs, the logsumexp L and the gradients are measured against the formula at float64 with the reference kernels'
own error at the input dtype as the yardstick (grader.kernels.attention_cases). The work check counts load lanes under
the interpreter and times the kernels on a GPU (grader.attention.window_cases). bfloat16 is graded on a GPU only.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from grader.attention import window_cases as wc
from grader.attention.speed_cases import SPEEDS
from grader.attention.window_cases import (
    FUNCTION,
    FUNCTION_CLASS,
    PADDED_HEAD_DIMS,
    PROBLEM,
    TIME_LENGTHS,
    TIME_WINDOW,
    WORK_LENGTHS,
    WORK_WINDOW,
    check_time_growth,
    check_work_growth,
    edge_case,
    probe_and_expect,
    run_probe,
    window_cases,
)
from grader.checks.compare import assert_raises
from grader.checks.marks import bf16_gpu_only, drawn_dtypes, gpu_only
from grader.checks.profiles import examples
from grader.kernels.attention_cases import (
    TRITON_MAX_BLOCK,
    check_blocks_bounded,
    check_gradients,
    check_lse,
    check_no_score_matrix,
    check_output,
)
from grader.session.context import current
from grader.speed.grading import grade_speed

DTYPES = drawn_dtypes(torch.float32, torch.float16)
TOLERANCE = dict(error_multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps)
# (seq, window): one visible key, windows one short of, at and past a tile and the sequence, a sequence of one.
EDGES = [(1, 1), (1, 5), (40, 1), (40, 2), (40, 16), (40, 17), (40, 32), (40, 33), (40, 39), (40, 40), (40, 41),
         (33, 1000)]

# Every profile grades a window far shorter than the sequence, which random draws under `ci` may miss.
SHORT_WINDOW = replace(edge_case(70, 9), heads=1, head_dim=32, layout="bnhd")
# Window 1 in float16: each query sees one key, so dq and dk are exactly 0 in truth; the reference's rounding noise is
# no yardstick there, and exact zeros pass (grader.kernels.attention_cases.check_gradient).
ONE_KEY_FP16 = edge_case(40, 1, torch.float16)


def check_forward(student, reference, case) -> None:
    q, k, v, _ = case.inputs()
    report, want = probe_and_expect(student, reference, case, q, k, v)
    check_output(report["output"], want, **TOLERANCE, context=case.describe(), function=FUNCTION)


@examples(PROBLEM)
@example(case=SHORT_WINDOW)
@example(case=PADDED_HEAD_DIMS[0])
@example(case=PADDED_HEAD_DIMS[1])
@example(case=PADDED_HEAD_DIMS[2])
@given(case=window_cases((torch.float32,)))
def test_forward_fp32(student, reference, case):
    check_forward(student, reference, case)


@examples(PROBLEM)
@given(case=window_cases((torch.float16,)))
def test_forward_fp16(student, reference, case):
    check_forward(student, reference, case)


@bf16_gpu_only
@examples(PROBLEM)
@given(case=window_cases((torch.bfloat16,)))
def test_forward_bf16(student, reference, case):
    check_forward(student, reference, case)


@examples(PROBLEM)
@given(case=window_cases(DTYPES))
def test_logsumexp(student, reference, case):
    """L = log sum over the visible keys of exp(S_ij), the fifth tensor of ctx.save_for_backward(q, k, v, o, L)."""
    q, k, v, _ = case.inputs()
    report, want = probe_and_expect(student, reference, case, q, k, v)
    check_lse(report, want, **TOLERANCE, context=case.describe(), cls=FUNCTION_CLASS)


@examples(PROBLEM)
@example(case=SHORT_WINDOW)
@example(case=PADDED_HEAD_DIMS[0])
@example(case=PADDED_HEAD_DIMS[1])
@example(case=PADDED_HEAD_DIMS[2])
@example(case=ONE_KEY_FP16)
@given(case=window_cases(DTYPES))
def test_backward(student, reference, case):
    q, k, v, grad_o = case.inputs()
    report, want = probe_and_expect(student, reference, case, q, k, v, grad_o)
    check_gradients(report, want, **TOLERANCE, context=case.describe())


@pytest.mark.parametrize("seq, window", EDGES, ids=[f"seq={s}-window={w}" for s, w in EDGES])
def test_window_edges(student, reference, seq, window):
    """i - window < j <= i at its edges: window 1 (o = v), windows around a tile, window = seq - 1, seq, past seq
    (causal attention). Output, L and all three gradients, float32."""
    case = edge_case(seq, window)
    q, k, v, grad_o = case.inputs()
    report, want = probe_and_expect(student, reference, case, q, k, v, grad_o)
    check_output(report["output"], want, **TOLERANCE, context=case.describe(), function=FUNCTION)
    check_lse(report, want, **TOLERANCE, context=case.describe(), cls=FUNCTION_CLASS)
    check_gradients(report, want, **TOLERANCE, context=case.describe())


@examples(PROBLEM, 0.5)
@given(case=window_cases(DTYPES, seq=st.integers(33, 80), window=st.integers(1, 20), head_dim=16, max_pairs=1))
def test_saves_no_score_matrix(student, case):
    """Forward and backward: exactly (q, k, v, o, L) saved, and no tensor with two dimensions of length seq built
    (seq > 32 exceeds head_dim and every other dimension)."""
    q, k, v, grad_o = case.inputs()
    report, _ = run_probe(student, case, q, k, v, grad_o)
    check_no_score_matrix(report, case.seq, case.describe(), cls=FUNCTION_CLASS)


@examples(PROBLEM, 0.25)
@given(case=window_cases(DTYPES, seq=st.integers(TRITON_MAX_BLOCK + 1, TRITON_MAX_BLOCK + 72),
                         window=st.integers(TRITON_MAX_BLOCK + 1, 3 * TRITON_MAX_BLOCK), head_dim=16,
                         max_pairs=1))
def test_blocks_bounded(student, case):
    """A window and a sequence longer than TRITON_MAX_BLOCK: no block of two or more dimensions in any kernel is
    longer than that along a dimension (grader.sandbox.triton_traffic)."""
    q, k, v, grad_o = case.inputs()
    report, _ = run_probe(student, case, q, k, v, grad_o)
    check_blocks_bounded(report, case.seq, case.describe())


def test_work_linear_in_seq(student):
    """With the window fixed, the work grows linearly in seq: the kernels skip the blocks outside every window.
    Under the interpreter (CPU), the lanes every load of forward and backward touched at seq = 256, 512 and 768;
    on a GPU, the time of forward and backward at seq = 4096 and 16384. Both are measured inside the worker."""
    if current().device.type == "cuda":
        times = student.run_program(f"{wc.__name__}:seconds_per_call", TIME_LENGTHS, TIME_WINDOW)
        check_time_growth(times, TIME_LENGTHS, TIME_WINDOW)
    else:
        check_work_growth(student.run_program(f"{wc.__name__}:loaded_lanes", WORK_LENGTHS, WORK_WINDOW),
                          WORK_LENGTHS, WORK_WINDOW)


def _tensors(*shapes, dtypes=(torch.float32,) * 3):
    return lambda device: tuple(torch.ones(s, dtype=d, device=device) for s, d in zip(shapes, dtypes))


SHAPE = (1, 2, 5, 16)
INVALID = [
    pytest.param(_tensors(SHAPE, SHAPE, SHAPE), 0, "ValueError", id="window=0"),
    pytest.param(_tensors(SHAPE, SHAPE, SHAPE), -3, "ValueError", id="window=-3"),
    pytest.param(_tensors(SHAPE, SHAPE, SHAPE), 2.0, "TypeError", id="window-float"),
    pytest.param(_tensors(SHAPE, SHAPE, SHAPE), True, "TypeError", id="window-bool"),
    pytest.param(_tensors((2, 5, 16), (2, 5, 16), (2, 5, 16)), 2, "ValueError", id="3-D"),
    pytest.param(_tensors(SHAPE, (1, 2, 7, 16), (1, 2, 7, 16)), 2, "ValueError", id="key-length-differs"),
    pytest.param(_tensors(SHAPE, SHAPE, (1, 2, 5, 32)), 2, "ValueError", id="value-dim-differs"),
    pytest.param(_tensors((1, 2, 5, 24), (1, 2, 5, 24), (1, 2, 5, 24)), 2, "ValueError", id="head_dim=24"),
    pytest.param(_tensors((1, 2, 0, 16), (1, 2, 0, 16), (1, 2, 0, 16)), 2, "ValueError", id="seq=0"),
    pytest.param(_tensors(SHAPE, SHAPE, SHAPE, dtypes=[torch.float64] * 3), 2, "TypeError", id="float64"),
    pytest.param(_tensors(SHAPE, SHAPE, SHAPE, dtypes=[torch.float32, torch.float16, torch.float32]), 2, "TypeError",
                 id="mixed-dtypes"),
]


@pytest.mark.parametrize("make_inputs, window, expected_error", INVALID)
def test_invalid_arguments(student, make_inputs, window, expected_error):
    q, k, v = make_inputs(current().device)
    assert_raises(student.raises(FUNCTION, q, k, v, window), expected_error,
                  f"{FUNCTION}(q, k, v, window={window!r}) for q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, "
                  f"v {tuple(v.shape)} {v.dtype}")


@gpu_only
@pytest.mark.parametrize("case", PROBLEM.speed.cases(), ids=str)
def test_speed(student, reference, partial_credit, case):
    grade_speed(SPEEDS[PROBLEM.id], student, reference, case, PROBLEM.speed, partial_credit)
