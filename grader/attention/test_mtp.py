"""Grading attention.mtp: DeepSeek-V3's multi-token prediction modules, their logits, loss and gradients.

Everything is measured against the reference model run in float64 (the oracle) with the grader's weights, the reference
at the case's dtype setting the tolerance (grader.attention.mtp_cases). The causal chain is checked on the student's
own logits: changing one token may move only the predictions that have read it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.attention import mtp_cases as mc
from grader.attention.mtp_cases import MTPCase, mtp_cases
from grader.checks.compare import assert_close, assert_raises
from grader.checks.marks import drawn_dtypes
from grader.checks.outcomes import StudentError, WrongAnswer
from grader.checks.profiles import examples

PROBLEM = BY_ID["attention.mtp"]
DTYPES = drawn_dtypes(torch.float32)
TOLERANCE = dict(multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps)
# Three depths over a sequence with one target at the last: every depth's alignment and the chain between them.
THREE_DEPTHS = MTPCase(batch=2, seq=9, vocab_size=16, d_model=16, n_heads=2, depth=3, seed=5)


def expected(reference, program: str, case: MTPCase, *args) -> tuple:
    """(the reference's program at float64, at the case's dtype)."""
    weights64, hidden64, tokens = mc.case_tensors(case, torch.float64)
    weights, hidden, _ = mc.case_tensors(case)
    function = getattr(mc, program)
    return (reference.computed(function, case.config(), weights64, hidden64, tokens, *args),
            reference.computed(function, case.config(), weights, hidden, tokens, *args))


def student_run(student, program: str, case: MTPCase, *args, expect=None):
    weights, hidden, tokens = mc.case_tensors(case)
    with student.describing(case.describe()):
        return student.run_program_beside(expect, f"{mc.__name__}:{program}", case.config(), weights, hidden, tokens,
                                          *args)


def check_logits(got, want64, want, case: MTPCase) -> None:
    if not isinstance(got, list) or len(got) != case.depth:
        raise WrongAnswer(f"forward must return a list of {case.depth} logits tensors, one per depth, got "
                          f"{type(got).__name__}{'' if not isinstance(got, list) else f' of {len(got)}'} "
                          f"({case.describe()})")
    for k, (actual, exact, at_dtype) in enumerate(zip(got, want64, want), start=1):
        assert_close(actual, exact, at_dtype, what=f"logits of depth {k} (shape [B, T - {k}, vocab_size])",
                     context=case.describe(), **TOLERANCE)


@examples(PROBLEM)
@example(case=THREE_DEPTHS)
@given(case=mtp_cases(DTYPES))
def test_logits(student, reference, case):
    got, (want64, want) = student_run(student, "run_logits", case,
                                      expect=lambda: expected(reference, "run_logits", case))
    check_logits(got, want64, want, case)


@examples(PROBLEM)
@example(case=THREE_DEPTHS)
@given(case=mtp_cases(DTYPES))
def test_loss(student, reference, case):
    """(loss_weight / D) * sum over depths of the mean cross-entropy over the positions with a target."""
    got, (want64, want) = student_run(student, "run_loss", case, False,
                                      expect=lambda: expected(reference, "run_loss", case, False))
    assert_close(got["loss"], want64["loss"], want["loss"], what="loss (L_MTP)", context=case.describe(),
                 **TOLERANCE)


@examples(PROBLEM)
@example(case=THREE_DEPTHS)
@given(case=mtp_cases(DTYPES))
def test_gradients(student, reference, case):
    """The gradients of the loss to h^0 and to every parameter: the shared embedding and head collect one
    contribution per depth that uses them."""
    got, (want64, want) = student_run(student, "run_loss", case, True,
                                      expect=lambda: expected(reference, "run_loss", case, True))
    if got["grads"] is None:
        raise WrongAnswer(f"loss(hidden, tokens) does not require grad for inputs that do ({case.describe()})")
    for name, exact in want64["grads"].items():
        actual = got["grads"].get(name)
        if actual is None:
            raise WrongAnswer(f"gradient of {name}: no gradient reached it ({case.describe()})")
        assert_close(actual, exact, want["grads"][name], what=f"gradient of {name}", context=case.describe(),
                     **TOLERANCE)


@examples(PROBLEM)
@example(case=THREE_DEPTHS, position=4)
@given(case=mtp_cases(DTYPES), position=st.integers(1, 40))
def test_causal_chain(student, case, position):
    """Changing token p moves no logits of depth k at positions i with i + k < p (they have read t_0 .. t_{i+k}),
    and moves those at i = p - k, which read t_p as their depth's embedding."""
    position = position % case.seq
    weights, hidden, tokens = mc.case_tensors(case)
    changed = tokens.clone()
    changed[:, position] = (tokens[:, position] + 1) % case.vocab_size
    with student.describing(f"{case.describe()}, token {position} changed"):
        before = student.run_program(f"{mc.__name__}:run_logits", case.config(), weights, hidden, tokens)
        after = student.run_program(f"{mc.__name__}:run_logits", case.config(), weights, hidden, changed)
    if not isinstance(before, list) or len(before) != case.depth or not all(
            isinstance(t, torch.Tensor) and t.shape[:2] == (case.batch, case.seq - k) for k, t in
            enumerate(before, start=1)):
        raise WrongAnswer(f"forward must return {case.depth} logits tensors of shape [B, T - k, vocab_size] "
                          f"({case.describe()})")
    for k, (first, second) in enumerate(zip(before, after), start=1):
        blind = max(0, min(position - k, case.seq - k))  # positions 0 .. p-k-1 have not read t_p
        moved = (first[:, :blind] - second[:, :blind]).abs().amax(dim=(0, 2)) if blind else torch.zeros(0)
        limit = 64 * torch.finfo(case.dtype).eps * float(first.abs().max())
        if (moved > limit).any():
            leak = int(torch.nonzero(moved > limit)[0])
            raise WrongAnswer(
                f"changing token {position} moved the logits of depth {k} at position {leak} by "
                f"{float(moved[leak]):.3g}: that prediction (of token {leak + k + 1}) has read tokens 0 .. "
                f"{leak + k} only, so it must not see token {position} ({case.describe()})")
        if 0 <= position - k < case.seq - k:
            i = position - k
            if torch.equal(first[:, i], second[:, i]):
                raise WrongAnswer(f"changing token {position} left the logits of depth {k} at position {i} "
                                  f"unchanged: depth {k} reads the embedding of token i + {k} there "
                                  f"({case.describe()})")


INVALID = [
    pytest.param("forward", (2, 5, 8), (2, 5), "float32", "TypeError", id="tokens-float"),
    pytest.param("forward", (2, 5, 8), (2, 5), "int32", "TypeError", id="tokens-int32"),
    pytest.param("forward", (2, 5, 8), (10,), "int64", "ValueError", id="tokens-1-D"),
    pytest.param("forward", (2, 5, 6), (2, 5), "int64", "ValueError", id="hidden-wrong-d_model"),
    pytest.param("forward", (2, 6, 8), (2, 5), "int64", "ValueError", id="hidden-other-length"),
    pytest.param("forward", (2, 3, 8), (2, 3), "int64", "ValueError", id="T=depth+1"),
    pytest.param("loss", (1, 3, 8), (1, 3), "int64", "ValueError", id="loss-T=depth+1"),
]


@pytest.mark.parametrize("method, hidden_shape, tokens_shape, tokens_dtype, expected_error", INVALID)
def test_invalid_arguments(student, method, hidden_shape, tokens_shape, tokens_dtype, expected_error):
    try:
        student.run_program(f"{mc.__name__}:call_invalid", method, hidden_shape, tokens_shape, tokens_dtype)
        raised = None
    except StudentError as error:
        raised = error
    assert_raises(raised, expected_error, f"MultiTokenPrediction.{method} with hidden {hidden_shape}, tokens "
                                          f"{tokens_shape} {tokens_dtype} (depth 2, d_model 8)")
