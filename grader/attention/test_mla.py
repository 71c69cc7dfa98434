"""Grading attention.mla: multi-head latent attention, its naive path over a sequence and its decode path that caches
only the latents and the rotary keys.

Both paths are measured against the reference layer run in float64 (the oracle) with the grader's weights, the
reference at the case's dtype setting the tolerance (grader.attention.mla_cases). The cache is measured by the grader
on the two tensors that come back from the worker, and decoding continues from them in a fresh layer.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import example, given

from assignment.registry import BY_ID
from grader.attention import mla_cases as mc
from grader.attention.mla_cases import MLACase, mla_cases
from grader.checks.compare import assert_close, assert_raises
from grader.checks.marks import drawn_dtypes
from grader.checks.outcomes import StudentError, WrongAnswer
from grader.checks.profiles import examples

PROBLEM = BY_ID["attention.mla"]
DTYPES = drawn_dtypes(torch.float32)
TOLERANCE = dict(multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps)
# Latents narrower than the heads' keys (12 against 4 x 8): per-head keys of the cache are the largest tensors a
# decode step can build, and rotary angles up to 40 radians.
DECODE_CASE = MLACase(batch=2, seq=40, d_model=32, n_heads=4, head_dim=8, latent_dim=12, rope_dim=6, prefill=20,
                      seed=3)
# Wide heads over narrow latents (8 x 64 against 8 + 4): every head's keys of a token are 1024 elements, an absorbed
# step builds about 100 per token (the budget, growth_budget, is 352), however they are split.
WORK_CASE = MLACase(batch=2, seq=24, d_model=32, n_heads=8, head_dim=64, latent_dim=8, rope_dim=4, prefill=12, seed=5)


def expected_forward(reference, case: MLACase, grads: bool) -> tuple[dict, dict]:
    weights64, h64, grad64 = mc.case_tensors(case, torch.float64)
    weights, h, grad = mc.case_tensors(case)
    return (reference.computed(mc.run_forward, case.config(), weights64, h64, grad64 if grads else None),
            reference.computed(mc.run_forward, case.config(), weights, h, grad if grads else None))


def expected_decode(reference, case: MLACase) -> tuple[dict, dict]:
    weights64, h64, _ = mc.case_tensors(case, torch.float64)
    weights, h, _ = mc.case_tensors(case)
    return (reference.computed(mc.run_prefill_decode, case.config(), weights64, h64, case.prefill),
            reference.computed(mc.run_prefill_decode, case.config(), weights, h, case.prefill))


def student_forward(student, case: MLACase, grads: bool, expected) -> tuple:
    weights, h, grad = mc.case_tensors(case)
    with student.describing(case.describe()):
        return student.run_program_beside(expected, f"{mc.__name__}:run_forward", case.config(), weights, h,
                                          grad if grads else None)


def student_decode(student, case: MLACase, expected=None) -> tuple:
    weights, h, _ = mc.case_tensors(case)
    with student.describing(case.describe()):
        return student.run_program_beside(expected, f"{mc.__name__}:run_prefill_decode", case.config(), weights, h,
                                          case.prefill)


@examples(PROBLEM)
@example(case=DECODE_CASE)
@given(case=mla_cases(DTYPES))
def test_forward(student, reference, case):
    got, (want64, want) = student_forward(student, case, False, lambda: expected_forward(reference, case, False))
    assert_close(got["y"], want64["y"], want["y"], what="MultiHeadLatentAttention.forward(h)",
                 context=case.describe(), **TOLERANCE)


@examples(PROBLEM)
@example(case=DECODE_CASE)
@given(case=mla_cases(DTYPES))
def test_gradients(student, reference, case):
    """The gradients of h and of every parameter, from an upstream gradient of the output."""
    got, (want64, want) = student_forward(student, case, True, lambda: expected_forward(reference, case, True))
    if got["grads"] is None:
        raise WrongAnswer(f"forward(h) does not require grad for inputs that do ({case.describe()})")
    for name, exact in want64["grads"].items():
        actual = got["grads"].get(name)
        if actual is None:
            raise WrongAnswer(f"gradient of {name}: no gradient reached it ({case.describe()})")
        assert_close(actual, exact, want["grads"][name], what=f"gradient of {name}", context=case.describe(),
                     **TOLERANCE)


@examples(PROBLEM)
@example(case=DECODE_CASE)
@given(case=mla_cases(DTYPES))
def test_decode_matches_forward(student, reference, case):
    """prefill(h[:, :P]) then decode one token at a time from the cache: the outputs of forward(h)."""
    got, (want64, want) = student_decode(student, case, lambda: expected_decode(reference, case))
    assert_close(got["y"], want64["y"], want["y"], what=f"prefill of {case.prefill} tokens, then decode",
                 context=case.describe(), **TOLERANCE)


@examples(PROBLEM)
@example(case=DECODE_CASE)
@given(case=mla_cases(DTYPES))
def test_cache_holds_latents_only(student, reference, case):
    """After prefill and after the last decode step the cache's length is the tokens so far, t, and its first t
    rows hold c [B, t, latent_dim] and k^R [B, t, rope_dim] of them, in the model's dtype: the latents and the
    rotated keys themselves."""
    got, (want64, want) = student_decode(student, case, lambda: expected_decode(reference, case))
    for stage, key, length in (("prefill", "prefill_length", case.prefill), ("decode", "length", case.seq)):
        if type(got[key]) is not int or got[key] != length:  # the type first: a tensor's != is no bool
            raise WrongAnswer(f"MLACache.length after {stage} must be the int {length}, the tokens it holds, got "
                              f"{got[key]!r} ({case.describe()})")
    for stage, length in (("prefill_cache", case.prefill), ("cache", case.seq)):
        for index, (name, size) in enumerate((("latent", case.latent_dim), ("rope_key", case.rope_dim))):
            actual = got[stage][index]
            shape = (case.batch, length, size)
            if not isinstance(actual, torch.Tensor) or tuple(actual.shape) != shape or actual.dtype != case.dtype:
                found = (f"{tuple(actual.shape)} {actual.dtype}" if isinstance(actual, torch.Tensor)
                         else type(actual).__name__)
                raise WrongAnswer(f"MLACache.{name} after {length} tokens must be {shape} "
                                  f"{str(case.dtype).removeprefix('torch.')}, got {found} ({case.describe()})")
            assert_close(actual, want64[stage][index], want[stage][index], what=f"MLACache.{name} after {length} "
                         f"tokens", context=case.describe(), **TOLERANCE)


def growth_budget(case: MLACase) -> int:
    """Elements a decode step may build per cached token: an absorbed step copies the cached latents and rotary keys
    a few times (appending, casting) and builds a few [B, H, t] score tensors; every head's keys are B H d_h."""
    return case.batch * (4 * (case.latent_dim + case.rope_dim) + 16 * case.n_heads)


def test_decode_builds_no_per_head_keys(student):
    """No decode step builds a tensor as large as every cached token's per-head keys ([B, H, t, d_h] elements with
    a dimension of t), nor that much in all (each head's keys one head at a time, say): the elements a step builds
    grow with the cache by at most growth_budget per token, far below B H d_h in WORK_CASE. The queries move into
    the latent space instead."""
    for case in (DECODE_CASE, WORK_CASE):
        got, _ = student_decode(student, case)
        if got["large"]:
            raise WrongAnswer(
                f"decode built tensors of at least B * H * t * head_dim elements with a dimension of the cache's "
                f"length t: {'; '.join(got['large'])}; the decode path scores the cached latents with the absorbed "
                f"query (W_UK,i^T q_i) and never rebuilds every head's keys or values ({case.describe()})")
        (first, built_first), (last, built_last) = got["built"][0], got["built"][-1]
        per_token = (built_last - built_first) / (last - first)
        if per_token > growth_budget(case):
            per_head_keys = case.batch * case.n_heads * case.head_dim
            raise WrongAnswer(
                f"decode built {built_first} elements in all (every tensor an operator returned) with t = {first} "
                f"tokens cached and {built_last} with t = {last}: {per_token:g} more per cached token, above the "
                f"{growth_budget(case)} = B (4 (latent_dim + rope_dim) + 16 n_heads) an absorbed step needs; every "
                f"head's keys of a token are B H head_dim = {per_head_keys} elements, whether built at once or one "
                f"head at a time: score the cached latents with the absorbed queries W_UK,i^T q_i instead "
                f"({case.describe()})")


def test_decode_appends_in_place(student):
    """A step whose cache has room (capacity above its length) writes the token's rows at position `length` of the
    cache's own tensors and returns them, copying nothing: the grader's cache holds room for half of DECODE_CASE's
    decode steps. The later steps must grow it, whichever way (test_decode_matches_forward checks they did)."""
    got, _ = student_decode(student, DECODE_CASE)
    if got["moved"]:
        first = got["moved"][0]
        raise WrongAnswer(
            f"decode returned the cache in new memory although the one it was given had room: {len(got['moved'])} "
            f"step(s), the first with t = {first} tokens cached; a copy reads and writes the whole cache once more "
            f"per step, more than the step itself reads: write the new token's latent and rotary key in place at "
            f"position length and return the same tensors with length + 1 ({DECODE_CASE.describe()})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cache_bytes(student, dtype):
    """cache_bytes_per_token() is (latent_dim + rope_dim) elements of the model's dtype, and the bytes the cache's
    tensors hold per token of their capacity after decoding."""
    case = replace(DECODE_CASE, dtype=dtype, seq=24)
    got, _ = student_decode(student, case)
    pinned = (case.latent_dim + case.rope_dim) * torch.finfo(dtype).bits // 8
    if got["bytes_per_token"] != pinned:
        raise WrongAnswer(f"cache_bytes_per_token() returned {got['bytes_per_token']!r}, expected (latent_dim + "
                          f"rope_dim) * element size = {pinned} ({case.describe()})")
    capacities = got["capacities"]
    if len(capacities) != 2 or capacities[0] != capacities[1]:
        raise WrongAnswer(f"after decoding, MLACache.latent and rope_key must be tensors of one capacity (their "
                          f"dimension 1), got {capacities} ({case.describe()})")
    per_token = got["cache_bytes"] / (case.batch * capacities[0])
    if per_token != pinned:
        raise WrongAnswer(f"after decoding, the cache's tensors hold {per_token:g} bytes per token of their "
                          f"capacity and sequence, cache_bytes_per_token() says {pinned} ({case.describe()})")


INVALID = [
    pytest.param("forward", (4, 16), "float32", "ValueError", id="forward-2-D"),
    pytest.param("forward", (1, 4, 15), "float32", "ValueError", id="forward-wrong-d_model"),
    pytest.param("forward", (1, 0, 16), "float32", "ValueError", id="forward-seq=0"),
    pytest.param("forward", (1, 4, 16), "int64", "TypeError", id="forward-int64"),
    pytest.param("decode", (1, 2, 16), "float32", "ValueError", id="decode-two-tokens"),
    pytest.param("decode", (2, 1, 16), "float32", "ValueError", id="decode-other-batch"),
]


@pytest.mark.parametrize("method, shape, dtype, expected_error", INVALID)
def test_invalid_arguments(student, method, shape, dtype, expected_error):
    try:
        student.run_program(f"{mc.__name__}:call_invalid", method, shape, dtype)
        raised = None
    except StudentError as error:
        raised = error
    assert_raises(raised, expected_error, f"MultiHeadLatentAttention.{method} with h of shape {shape} {dtype}")
