"""Grading attention.sparse_dsa: the lightning indexer, the top-k selection, and attention over the selected keys in
Triton, forward and backward.

The indexer's scores are measured against the formula at float64, its -inf pattern exactly; the selection against
the reference exactly (it is integers), and the reference against the pinned rule written out row by row. The
attention's output, logsumexp L and gradients are measured against the formula at float64 with the reference kernels'
own error at the input dtype as the yardstick (grader.kernels.attention_cases). The work check counts load lanes under
the interpreter and times the kernels on a GPU (grader.attention.dsa_cases). bfloat16 is graded on a GPU only.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from grader.attention import dsa_cases as dc
from grader.attention.dsa_cases import (
    FUNCTION,
    FUNCTION_CLASS,
    PADDED_HEAD_DIMS,
    PADDED_INDEX_DIMS,
    PROBLEM,
    SELECTIONS,
    TIME_LENGTHS,
    TIME_TOPK,
    WORK_LENGTHS,
    WORK_TOPK,
    IndexerCase,
    SparseCase,
    TopkCase,
    check_saved,
    check_time_growth,
    check_work_growth,
    indexer_cases,
    probe_and_expect,
    run_probe,
    sparse_cases,
    topk_cases,
)
from grader.attention.speed_cases import SPEEDS
from grader.checks.compare import assert_close, assert_contiguous, assert_equal, assert_raises
from grader.checks.marks import bf16_gpu_only, drawn_dtypes, gpu_only
from grader.checks.profiles import examples
from grader.kernels.attention_cases import (
    TRITON_MAX_BLOCK,
    check_blocks_bounded,
    check_gradients,
    check_lse,
)
from grader.session.context import current
from grader.speed.grading import grade_speed

DTYPES = drawn_dtypes(torch.float32, torch.float16)
TOLERANCE = dict(error_multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps)


# --- the indexer -------------------------------------------------------------------------------------------------


def indexer_expected(reference, case: IndexerCase, q_idx, k_idx, weights) -> tuple[torch.Tensor, torch.Tensor]:
    exact = reference.indexer_scores_torch(*case.exact_inputs())
    return exact, reference.indexer_scores(q_idx, k_idx, weights)


def call_student(student, function: str, *args, grader_work=None):
    """(module.function(*args) in the worker with any torch operator allowed, grader_work()): the indexer and the
    top-k may compute in torch; only sparse_attention is held to Triton."""
    return student.run_program_beside(grader_work, f"{dc.__name__}:call_unwatched", function, *args)


@examples(PROBLEM)
@example(case=PADDED_INDEX_DIMS[0])
@example(case=PADDED_INDEX_DIMS[1])
@example(case=PADDED_INDEX_DIMS[2])
@given(case=indexer_cases(DTYPES))
def test_indexer(student, reference, case):
    """scores[b, t, s] = sum_j weights[b, t, j] relu(q_idx[b, t, j] . k_idx[b, s]) for s <= t, exactly -inf above."""
    q_idx, k_idx, weights = case.inputs()
    with student.describing(case.describe()):
        actual, (exact, at_dtype) = call_student(
            student, "indexer_scores", q_idx, k_idx, weights,
            grader_work=lambda: reference.computed(indexer_expected, case, q_idx, k_idx, weights))
    assert_equal(torch.isneginf(actual).cpu() if isinstance(actual, torch.Tensor) else actual, torch.isneginf(exact),
                 what="where indexer_scores is -inf (exactly the keys s > t)", context=case.describe())
    finite = torch.isfinite(exact)
    assert_close(actual.masked_fill(~finite.to(actual.device), 0.0), exact.masked_fill(~finite, 0.0),
                 at_dtype.masked_fill(~finite.to(at_dtype.device), 0.0), what="indexer_scores", context=case.describe(),
                 multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps)


# --- the top-k ---------------------------------------------------------------------------------------------------


def check_topk(student, reference, case: TopkCase) -> None:
    scores = case.scores(current().device)
    with student.describing(case.describe()):
        actual, want = call_student(student, "select_topk", scores, case.topk,
                                    grader_work=lambda: reference.select_topk(scores, case.topk))
    assert_equal(actual, want, what="select_topk", context=case.describe())


@examples(PROBLEM)
@example(case=TopkCase(2, 24, 5, values="ties", seed=1))
@given(case=topk_cases())
def test_topk(student, reference, case):
    """The topk highest scores among s <= t, equal scores to the lower key, ascending, -1 at the row's end; the
    scores above the diagonal (huge, +inf) ignored."""
    check_topk(student, reference, case)


TOPK_EDGES = [TopkCase(1, 1, 1), TopkCase(1, 1, 4), TopkCase(2, 9, 1), TopkCase(1, 9, 9), TopkCase(1, 9, 12),
              TopkCase(1, 20, 5, values="equal"), TopkCase(2, 20, 7, values="normal", seed=3)]


@pytest.mark.parametrize("case", TOPK_EDGES, ids=lambda c: f"seq={c.seq}-topk={c.topk}-{c.values}")
def test_topk_edges(student, reference, case):
    """A sequence of one; topk 1, seq and past seq; every score equal (the first topk keys of each row)."""
    check_topk(student, reference, case)


# --- attention over the selected keys ----------------------------------------------------------------------------


def check_output(report: dict, want, case: SparseCase) -> None:
    assert_contiguous(report["output"], "output o of sparse_attention", case.describe())
    assert_close(report["output"], want.output64, want.at_dtype["output"], what="output o of sparse_attention",
                 context=case.describe(), multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps)


def check_forward(student, reference, case: SparseCase) -> None:
    q, k, v, indices, _ = case.inputs()
    report, want = probe_and_expect(student, reference, case, q, k, v, indices)
    check_output(report, want, case)


@examples(PROBLEM)
@example(case=PADDED_HEAD_DIMS[0])
@example(case=PADDED_HEAD_DIMS[1])
@example(case=PADDED_HEAD_DIMS[2])
@given(case=sparse_cases((torch.float32,)))
def test_forward_fp32(student, reference, case):
    check_forward(student, reference, case)


@examples(PROBLEM)
@given(case=sparse_cases((torch.float16,)))
def test_forward_fp16(student, reference, case):
    check_forward(student, reference, case)


@bf16_gpu_only
@examples(PROBLEM)
@given(case=sparse_cases((torch.bfloat16,)))
def test_forward_bf16(student, reference, case):
    check_forward(student, reference, case)


@examples(PROBLEM)
@given(case=sparse_cases(DTYPES))
def test_logsumexp(student, reference, case):
    """L = log sum over the selected keys of exp(S), the fifth tensor of ctx.save_for_backward(q, k, v, o, L,
    indices)."""
    q, k, v, indices, _ = case.inputs()
    report, want = probe_and_expect(student, reference, case, q, k, v, indices)
    check_lse(report, want, **TOLERANCE, context=case.describe(), cls=FUNCTION_CLASS)


@examples(PROBLEM)
@example(case=PADDED_HEAD_DIMS[0])
@example(case=PADDED_HEAD_DIMS[1])
@example(case=PADDED_HEAD_DIMS[2])
@given(case=sparse_cases(DTYPES))
def test_backward(student, reference, case):
    q, k, v, indices, grad_o = case.inputs()
    report, want = probe_and_expect(student, reference, case, q, k, v, indices, grad_o)
    check_gradients(report, want, **TOLERANCE, context=case.describe())


SELECTION_CASES = [SparseCase(batch=2, seq=37, heads=3, head_dim=16, topk=topk, dtype=torch.float32,
                              selection=selection, seed=index)
                   for index, (selection, topk) in enumerate(zip(SELECTIONS, (20, 24, 9, 5)))]


@pytest.mark.parametrize("case", SELECTION_CASES, ids=lambda c: c.selection)
def test_selections(student, reference, case):
    """Each kind of selection, output, L and the three gradients (float32): causal top-k of random scores; keys
    anywhere, in any order, -1 in any slot; every query selecting the same keys (each of their dK and dV rows sums
    every query); one key per query."""
    q, k, v, indices, grad_o = case.inputs()
    report, want = probe_and_expect(student, reference, case, q, k, v, indices, grad_o)
    check_output(report, want, case)
    check_lse(report, want, **TOLERANCE, context=case.describe(), cls=FUNCTION_CLASS)
    check_gradients(report, want, **TOLERANCE, context=case.describe())


@examples(PROBLEM, 0.5)
@given(case=sparse_cases(DTYPES, seq=st.integers(33, 80), topk=st.integers(1, 20), head_dim=16,
                         heads=st.integers(1, 4)))
def test_saves_no_score_matrix(student, case):
    """Forward and backward: exactly (q, k, v, o, L, indices) saved, and no tensor with two dimensions of length seq
    built (seq > 32 exceeds topk, head_dim and every other dimension)."""
    q, k, v, indices, grad_o = case.inputs()
    report, _ = run_probe(student, case, q, k, v, indices, grad_o)
    check_saved(report, case.seq, case.describe())


@examples(PROBLEM, 0.25)
@given(case=sparse_cases(DTYPES, seq=st.integers(TRITON_MAX_BLOCK + 1, TRITON_MAX_BLOCK + 40),
                         topk=st.integers(TRITON_MAX_BLOCK + 1, TRITON_MAX_BLOCK + 40), head_dim=16,
                         heads=st.integers(1, 2), selections=("causal",), max_batch=1))
def test_blocks_bounded(student, case):
    """topk and seq longer than TRITON_MAX_BLOCK: no block of two or more dimensions in any kernel is longer than
    that along a dimension (grader.sandbox.triton_traffic)."""
    q, k, v, indices, grad_o = case.inputs()
    report, _ = run_probe(student, case, q, k, v, indices, grad_o)
    check_blocks_bounded(report, case.seq, case.describe())


def test_work_linear_in_seq(student):
    """With topk fixed, the work grows linearly in seq: the kernels load the selected keys only. Under the
    interpreter (CPU), the lanes every load of forward and backward touched at seq = 32, 64 and 96; on a GPU,
    the time of forward and backward at seq = 4096 and 16384. Both are measured inside the worker."""
    if current().device.type == "cuda":
        check_time_growth(student.run_program(f"{dc.__name__}:seconds_per_call", TIME_LENGTHS, TIME_TOPK),
                          TIME_LENGTHS, TIME_TOPK)
    else:
        check_work_growth(student.run_program(f"{dc.__name__}:loaded_lanes", WORK_LENGTHS, WORK_TOPK),
                          WORK_LENGTHS, WORK_TOPK)


# --- invalid arguments: one fault each ---------------------------------------------------------------------------


def _floats(*shapes, dtypes=None):
    dtypes = dtypes or (torch.float32,) * len(shapes)
    return lambda device: tuple(torch.ones(s, dtype=d, device=device) for s, d in zip(shapes, dtypes))


def _attention_args(q_shape=(1, 5, 2, 16), kv_shapes=((1, 5, 16), (1, 5, 16)), indices_shape=(1, 5, 3),
                    dtypes=(torch.float32,) * 3, index_dtype=torch.int64):
    def make(device):
        q, k, v = (torch.ones(s, dtype=d, device=device) for s, d in zip((q_shape, *kv_shapes), dtypes))
        return q, k, v, torch.zeros(indices_shape, dtype=index_dtype, device=device)
    return make


INVALID = [
    pytest.param("indexer_scores", _floats((1, 5, 2, 24), (1, 5, 24), (1, 5, 2)), "ValueError", id="index_dim=24"),
    pytest.param("indexer_scores", _floats((1, 5, 2, 16), (1, 6, 16), (1, 5, 2)), "ValueError",
                 id="index-key-length-differs"),
    pytest.param("indexer_scores", _floats((1, 5, 2, 16), (1, 5, 16), (1, 5, 3)), "ValueError",
                 id="weights-heads-differ"),
    pytest.param("indexer_scores", _floats((1, 5, 2, 16), (1, 5, 16), (1, 5, 2),
                                           dtypes=(torch.float32, torch.float16, torch.float32)),
                 "TypeError", id="index-mixed-dtypes"),
    pytest.param("select_topk", lambda device: (torch.zeros(1, 4, 4, device=device), 0), "ValueError",
                 id="topk=0"),
    pytest.param("select_topk", lambda device: (torch.zeros(1, 4, 4, device=device), True), "TypeError",
                 id="topk-bool"),
    pytest.param("select_topk", lambda device: (torch.zeros(1, 4, 5, device=device), 2), "ValueError",
                 id="scores-not-square"),
    pytest.param("select_topk", lambda device: (torch.zeros(1, 4, 4, dtype=torch.float64, device=device), 2),
                 "TypeError", id="scores-float64"),
    pytest.param(FUNCTION, _attention_args(kv_shapes=((1, 5, 2, 16), (1, 5, 2, 16))), "ValueError",
                 id="per-head-keys"),
    pytest.param(FUNCTION, _attention_args(kv_shapes=((1, 6, 16), (1, 6, 16))), "ValueError",
                 id="key-length-differs"),
    pytest.param(FUNCTION, _attention_args(kv_shapes=((1, 5, 16), (1, 6, 16))), "ValueError",
                 id="value-length-differs"),
    pytest.param(FUNCTION, _attention_args(indices_shape=(1, 4, 3)), "ValueError", id="indices-seq-differs"),
    pytest.param(FUNCTION, _attention_args(indices_shape=(1, 5, 0)), "ValueError", id="topk=0"),
    pytest.param(FUNCTION, _attention_args(index_dtype=torch.int32), "TypeError", id="indices-int32"),
    pytest.param(FUNCTION, _attention_args(q_shape=(1, 5, 2, 24), kv_shapes=((1, 5, 24), (1, 5, 24))), "ValueError",
                 id="head_dim=24"),
    pytest.param(FUNCTION, _attention_args(dtypes=(torch.float32, torch.float16, torch.float32)), "TypeError",
                 id="mixed-dtypes"),
]


@pytest.mark.parametrize("function, make_args, expected_error", INVALID)
def test_invalid_arguments(student, function, make_args, expected_error):
    args = make_args(current().device)
    shapes = ", ".join(f"{tuple(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor) else repr(a) for a in args)
    assert_raises(student.raises(function, *args), expected_error, f"{function}({shapes})")


@gpu_only
@pytest.mark.parametrize("case", PROBLEM.speed.cases(), ids=str)
def test_speed(student, reference, partial_credit, case):
    grade_speed(SPEEDS[PROBLEM.id], student, reference, case, PROBLEM.speed, partial_credit)
