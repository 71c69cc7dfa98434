"""Grading attention.hybrid: a stack of Gated DeltaNet and causal softmax attention layers, run over a whole sequence
and as prefill plus token-by-token decoding.

Both modes are measured against the reference stack run in float64 (the oracle) with the grader's weights, the
reference at the case's dtype setting the tolerance (grader.attention.hybrid_cases). The cache is measured by the
grader on the tensors that come back from the worker, and decoding continues from them in a fresh stack: its bytes
in float32 and bfloat16, and its contents (every GDN state, every attention layer's keys and values) against the
reference's after the prompt and after the last decoded token.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import example, given

from assignment.registry import BY_ID
from grader.attention import hybrid_cases as hc
from grader.attention.hybrid_cases import HybridCase, hybrid_cases
from grader.checks.compare import assert_close, assert_raises
from grader.checks.marks import drawn_dtypes
from grader.checks.outcomes import StudentError, WrongAnswer
from grader.checks.profiles import examples

PROBLEM = BY_ID["attention.hybrid"]
DTYPES = drawn_dtypes(torch.float32)
TOLERANCE = dict(multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps)
# The cache tests' stack: L L L A, so both kinds of entry are measured.
# Past a chunk of 64 tokens, with a prompt that ends inside the second: where a chunked form hands its state on.
LONG_CASE = HybridCase(batch=1, seq=80, d_model=16, n_heads=1, head_dim=8, n_layers=2, attention_every=2, prefill=70,
                       seed=3)
# A one-token prompt, then decoding: the second token's attention sees a cache of one key and its own (a shortcut
# that treats one cached key as none, or aligns a causal mask to the top left, shows only here).
ONE_TOKEN_PROMPT_CASE = HybridCase(batch=2, seq=4, d_model=16, n_heads=2, head_dim=8, n_layers=2, attention_every=2,
                                   prefill=1, seed=7)
# d_model = n_heads * head_dim: a cache of anything [B, t, d_model] per token (the normalised inputs, say) has the
# bytes of the keys and values, so the cache's contents are compared too (test_decode_matches_forward).
CACHE_CASE = HybridCase(batch=2, seq=hc.LONG_PREFILL, d_model=32, n_heads=2, head_dim=16, n_layers=4,
                        attention_every=4, seed=11)
# The cache's bytes in both graded dtypes: a bfloat16 model keeps its keys and values in bfloat16, its states in
# float32. Plain PyTorch, so bfloat16 runs on a CPU too.
CACHE_CASES = tuple(replace(CACHE_CASE, dtype=dtype) for dtype in (torch.float32, torch.bfloat16))


def expected_forward(reference, case: HybridCase, grads: bool) -> tuple[dict, dict]:
    """(the reference stack's forward at float64, at the case's dtype), with gradients if asked."""
    weights64, x64, grad64 = hc.case_tensors(case, torch.float64)
    weights, x, grad_y = hc.case_tensors(case)
    return (reference.computed(hc.run_forward, case.config(), weights64, x64, grad64 if grads else None),
            reference.computed(hc.run_forward, case.config(), weights, x, grad_y if grads else None))


def student_forward(student, case: HybridCase, grads: bool, expected) -> tuple[dict, tuple]:
    weights, x, grad_y = hc.case_tensors(case)
    with student.describing(case.describe()):
        return student.run_program_beside(expected, f"{hc.__name__}:run_forward", case.config(), weights, x,
                                          grad_y if grads else None)


@examples(PROBLEM)
@example(case=LONG_CASE)
@given(case=hybrid_cases(DTYPES))
def test_forward(student, reference, case):
    got, (want64, want) = student_forward(student, case, False, lambda: expected_forward(reference, case, False))
    assert_close(got["y"], want64["y"], want["y"], what="HybridStack.forward(x)", context=case.describe(),
                 **TOLERANCE)


@examples(PROBLEM)
@example(case=LONG_CASE)
@given(case=hybrid_cases(DTYPES))
def test_gradients(student, reference, case):
    """The gradients of x and of every parameter, from an upstream gradient of y."""
    got, (want64, want) = student_forward(student, case, True, lambda: expected_forward(reference, case, True))
    if got["grads"] is None:
        raise WrongAnswer(f"HybridStack.forward(x) does not require grad for inputs that do ({case.describe()})")
    for name, exact in want64["grads"].items():
        actual = got["grads"].get(name)
        if actual is None:
            raise WrongAnswer(f"gradient of {name}: no gradient reached it ({case.describe()})")
        assert_close(actual, exact, want["grads"][name], what=f"gradient of {name}", context=case.describe(),
                     **TOLERANCE)


def prefill_then_decode(student, case: HybridCase, weights, x, expected=None) -> tuple[dict, dict, object]:
    """(prefill of x[:, :P], decoding of the rest from its cache in a fresh stack, expected())."""
    with student.describing(case.describe()):
        prefilled, want = student.run_program_beside(expected, f"{hc.__name__}:run_prefill", case.config(), weights,
                                                     x[:, :case.prefill])
        decoded = student.run_program(f"{hc.__name__}:run_decode", case.config(), weights, x[:, case.prefill:],
                                      prefilled["cache"])
    return prefilled, decoded, want


def check_entry_count(run: dict, tokens: int, case: HybridCase) -> None:
    if len(run["cache"]) != case.n_layers:
        raise WrongAnswer(f"the cache after {tokens} tokens has {len(run['cache'])} entries in cache.layers; "
                          f"expected one per layer ({case.n_layers}) ({case.describe()})")


def assert_cache_close(got: dict, want64: dict, yardsticks: tuple[dict, ...], tokens: int, case: HybridCase) -> None:
    """The cache after `tokens` tokens holds what the contract says: every GDN layer's state S [B, n_heads, head_dim
    (keys), head_dim (values)], every attention layer's keys and values as k_proj and v_proj produced them."""
    check_entry_count(got, tokens, case)
    entries = got["cache"]
    for layer in range(case.n_layers):
        if layer in case.attention_layers():
            if not isinstance(entries[layer], (tuple, list)) or len(entries[layer]) != 2:
                raise WrongAnswer(f"attention layer {layer}'s cache entry after {tokens} tokens is not a pair "
                                  f"(k_cache, v_cache) ({case.describe()})")
            parts = (("k_cache", "the keys k_proj(norm(x))"), ("v_cache", "the values v_proj(norm(x))"))
            for index, (name, holds) in enumerate(parts):
                assert_close(entries[layer][index], want64["cache"][layer][index],
                             tuple(y["cache"][layer][index] for y in yardsticks),
                             what=f"attention layer {layer}'s {name} after {tokens} tokens (must hold {holds} of "
                                  f"every token so far, [B, n_heads, t, head_dim])",
                             context=case.describe(), **TOLERANCE)
        else:
            assert_close(entries[layer], want64["cache"][layer], tuple(y["cache"][layer] for y in yardsticks),
                         what=f"Gated DeltaNet layer {layer}'s state after {tokens} tokens (S [B, n_heads, head_dim "
                              f"(keys), head_dim (values)])", context=case.describe(), **TOLERANCE)


@examples(PROBLEM)
@example(case=LONG_CASE)
@example(case=ONE_TOKEN_PROMPT_CASE)
@given(case=hybrid_cases(DTYPES))
def test_decode_matches_forward(student, reference, case):
    """prefill(x[:, :P]) then decode of x[:, P], x[:, P+1], ... gives forward(x): the prompt's outputs and every decoded
    token's, against the float64 forward; and the cache after the prompt and after the last token holds the states,
    keys and values of the tokens so far."""
    weights, x, _ = hc.case_tensors(case)

    def expected():
        weights64, x64, _ = hc.case_tensors(case, torch.float64)
        # A prefill's y is forward's, and its cache is the one decoding must reach: one call gives both.
        whole64 = reference.computed(hc.run_prefill, case.config(), weights64, x64)
        prompt64 = reference.computed(hc.run_prefill, case.config(), weights64, x64[:, :case.prefill])
        whole = reference.computed(hc.run_prefill, case.config(), weights, x)
        ref_prefill = reference.computed(hc.run_prefill, case.config(), weights, x[:, :case.prefill])
        ref_decode = reference.computed(hc.run_decode, case.config(), weights, x[:, case.prefill:],
                                        ref_prefill["cache"])
        return (whole64, prompt64), (whole, ref_prefill, ref_decode)

    prefilled, decoded, ((whole64, prompt64), (whole, ref_prefill, ref_decode)) = prefill_then_decode(
        student, case, weights, x, expected)
    want64, yardsticks = whole64["y"], (whole["y"], torch.cat([ref_prefill["y"], ref_decode["y"]], dim=1))
    what = f"HybridStack.prefill(x[:, :{case.prefill}])"
    assert_close(prefilled["y"], want64[:, :case.prefill], tuple(y[:, :case.prefill] for y in yardsticks),
                 what=f"y of {what}", context=case.describe(), **TOLERANCE)
    if case.prefill < case.seq:
        assert_close(decoded["y"], want64[:, case.prefill:], tuple(y[:, case.prefill:] for y in yardsticks),
                     what=f"decode() of tokens {case.prefill}..{case.seq - 1} after {what}, from its cache in a "
                          f"fresh stack", context=case.describe(), **TOLERANCE)
    assert_cache_close(prefilled, prompt64, (ref_prefill,), case.prefill, case)
    assert_cache_close(decoded, whole64, (ref_decode, whole), case.seq, case)


def measured_caches(student, case: HybridCase) -> dict:
    """The caches after SHORT_PREFILL and LONG_PREFILL tokens and after one decoded token more, as returned."""
    weights, _, _ = hc.case_tensors(case)
    x, _ = case.exact_inputs(hc.LONG_PREFILL + 1)
    x = x.to(weights["final_norm.weight"].device, case.dtype)
    with student.describing(case.describe()):
        short = student.run_program(f"{hc.__name__}:run_prefill", case.config(), weights, x[:, :hc.SHORT_PREFILL])
        long = student.run_program(f"{hc.__name__}:run_prefill", case.config(), weights, x[:, :hc.LONG_PREFILL])
        one_more = student.run_program(f"{hc.__name__}:run_decode", case.config(), weights,
                                       x[:, hc.LONG_PREFILL:], long["cache"])
    caches = {hc.SHORT_PREFILL: short, hc.LONG_PREFILL: long, hc.LONG_PREFILL + 1: one_more}
    for tokens, run in caches.items():
        check_entry_count(run, tokens, case)
    return caches


def state_bytes(case: HybridCase) -> int:
    """One GDN layer's pinned state: [B, n_heads, head_dim, head_dim] in float32 (float64 for a float64 model)."""
    return case.batch * case.n_heads * case.head_dim**2 * (8 if case.dtype == torch.float64 else 4)


def kv_bytes(case: HybridCase, tokens: int) -> int:
    return 2 * case.batch * case.n_heads * tokens * case.head_dim * torch.finfo(case.dtype).bits // 8


def test_linear_state_is_constant(student):
    """Every GDN layer's cache entry holds the same bytes after 64, 4096 and 4097 tokens: the pinned state, of a
    float32 and of a bfloat16 model."""
    for case in CACHE_CASES:
        caches = measured_caches(student, case)
        for layer in range(case.n_layers):
            if layer in case.attention_layers():
                continue
            sizes = {tokens: hc.entry_bytes(run["cache"][layer]) for tokens, run in caches.items()}
            if set(sizes.values()) != {state_bytes(case)}:
                raise WrongAnswer(
                    f"Gated DeltaNet layer {layer}'s cache entry holds {sizes} bytes after that many tokens; a state "
                    f"of [B, n_heads, head_dim, head_dim] float32 is {state_bytes(case)} bytes whatever the length "
                    f"({case.describe()})")


def test_kv_cache_grows(student):
    """Every attention layer's (k_cache, v_cache) holds 2 B n_heads t head_dim elements of the model's dtype after t
    tokens, in a float32 and in a bfloat16 model."""
    for case in CACHE_CASES:
        caches = measured_caches(student, case)
        for layer in case.attention_layers():
            for tokens, run in caches.items():
                held = hc.entry_bytes(run["cache"][layer])
                if held != kv_bytes(case, tokens):
                    raise WrongAnswer(
                        f"attention layer {layer}'s (k_cache, v_cache) holds {held} bytes after {tokens} tokens; the "
                        f"keys and values of {tokens} tokens in the model's dtype "
                        f"({str(case.dtype).removeprefix('torch.')}) are {kv_bytes(case, tokens)} bytes "
                        f"({case.describe()})")


def test_cache_bytes(student):
    """cache_bytes(cache) is the bytes of the cache's tensors (the grader's count of what came back) and the pinned
    formula, after a prefill and after a decode step, of a float32 and of a bfloat16 model."""
    for case in CACHE_CASES:
        caches = measured_caches(student, case)
        gdn_layers = case.n_layers - len(case.attention_layers())
        for tokens, run in caches.items():
            counted = sum(hc.entry_bytes(entry) for entry in run["cache"])
            formula = gdn_layers * state_bytes(case) + len(case.attention_layers()) * kv_bytes(case, tokens)
            if run["cache_bytes"] != counted or counted != formula:
                raise WrongAnswer(
                    f"after {tokens} tokens cache_bytes(cache) returned {run['cache_bytes']!r}; the cache's tensors "
                    f"hold {counted} bytes and the pinned formula gives {formula} ({case.describe()})")


INVALID = [
    pytest.param("forward", (4, 32), "ValueError", id="forward-2-D"),
    pytest.param("forward", (1, 4, 31), "ValueError", id="forward-wrong-d_model"),
    pytest.param("forward", (1, 0, 32), "ValueError", id="forward-seq=0"),
    pytest.param("decode", (1, 2, 32), "ValueError", id="decode-two-tokens"),
    pytest.param("decode", (2, 1, 32), "ValueError", id="decode-other-batch"),
]


@pytest.mark.parametrize("method, shape, expected_error", INVALID)
def test_invalid_arguments(student, method, shape, expected_error):
    try:
        student.run_program(f"{hc.__name__}:call_invalid", method, shape)
        raised = None
    except StudentError as error:
        raised = error
    assert_raises(raised, expected_error, f"HybridStack {method} with input of shape {shape}")
