"""Grading attention.analysis: the attention family's analysis questions, read from the student's answer sheet.

Derived answers are compared with the grader's derivation, written out below from each question's numbers. Two
answers are measured. The sliding window's speedup: on a GPU the grader times the student's own
sliding_window_attention beside torch's causal flash attention as the problem's speed test does, and the answer must
be within MEASURED_REL_TOL (grader.checks.answers) of that; without a GPU it can only check that the speedup is
consistent with the work saved. Linear attention's crossover length: on a GPU the grader runs the search the question
describes on the student's own linear_attention_chunked and accepts an answer from two powers of two below what it
finds to one above; without a GPU it can only check that the answer is one of the lengths searched. Either says so.
"""

from __future__ import annotations

import math

from assignment.registry import BY_ID
from grader.attention.speed_cases import SPEEDS
from grader.checks.answers import check_baseline_over_kernel, check_derived, measurable_here, number
from grader.checks.marks import timed_on_gpu
from grader.checks.outcomes import WrongAnswer

# The speed test's second case: (batch, heads, seq, head_dim, window) in bfloat16.
WINDOW_CASE = (BY_ID["attention.sliding_window"].speed.shapes[1], "bfloat16")
# A kernel that skips work cannot gain much more than the work it skips; doing each pair faster than torch's
# kernel can beat that ratio a little (the reference, on the H200: 5.02 against 4.27, 1.18 times).
MOST_OVER_WORK_RATIO = 1.5
# The crossover search: linear attention against torch's causal flash attention, forward and backward, bfloat16, at
# batch 4, 16 heads, head size 128 (the speed test's first shape) and these lengths; BEYOND_SEARCH if at none of them.
CROSSOVER_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
BEYOND_SEARCH = 32768
# Accepted answers, in powers of two from the grader's crossover: noise near it moves it one step either way, and the
# worker the grader times in adds host time to each call (on the H200 the reference's crossover is 2048 timed in its
# own process, 4096 in the worker), which can only move the grader's crossover up.
CROSSOVER_STEPS_BELOW, CROSSOVER_STEPS_ABOVE = 2, 1


def causal_pairs(seq: int) -> int:
    return seq * (seq + 1) // 2


def capped_pairs(seq: int, cap: int) -> int:
    """Query-key pairs when query t sees min(t + 1, cap) keys: a sliding window of cap keys, or top-cap selection."""
    ramp = min(seq, cap)
    return ramp * (ramp + 1) // 2 + (seq - ramp) * cap


def window_work_ratio(seq: int, window: int) -> float:
    return causal_pairs(seq) / capped_pairs(seq, window)


def test_window_work_ratio(sheet):
    check_derived(sheet, "window_work_ratio", window_work_ratio(8192, 1024), rel_tol=0.001)


@timed_on_gpu
def test_sliding_window_speedup(sheet, student_of, partial_credit):
    speedup = number(sheet, "sliding_window_speedup")
    (_, _, seq, _, window), _ = WINDOW_CASE
    most = MOST_OVER_WORK_RATIO * window_work_ratio(seq, window)
    if not 0 < speedup <= most:
        raise WrongAnswer(f"sliding_window_speedup: {speedup:g} is not a speedup this window allows (0 to "
                          f"{most:.2f}: {MOST_OVER_WORK_RATIO} x the ratio of the work)")
    window_attention = student_of("attention.sliding_window")  # a measurement needs the kernel written
    check_baseline_over_kernel("sliding_window_speedup", speedup, SPEEDS["attention.sliding_window"], window_attention,
                               WINDOW_CASE, f"torch's causal flash over your sliding window, forward and backward, "
                               f"{WINDOW_CASE}", partial_credit, "kernel")


def crossover_seq(linear_attention) -> int:
    """The first length of CROSSOVER_SEQS at which the student's chunked linear attention beats flash attention."""
    spec = SPEEDS["attention.linear_attention"]
    for seq in CROSSOVER_SEQS:
        medians = spec.against_baseline(linear_attention, ((4, 16, seq, 128), "bfloat16"))
        if medians["student"] < medians["baseline"]:
            return seq
    return BEYOND_SEARCH


@timed_on_gpu
def test_linear_attention_crossover_seq(sheet, student_of, partial_credit):
    seq = number(sheet, "linear_attention_crossover_seq")
    searched = (*CROSSOVER_SEQS, BEYOND_SEARCH)
    if seq not in searched:
        raise WrongAnswer(f"linear_attention_crossover_seq: {seq:g} is not one of the lengths the question names "
                          f"({', '.join(map(str, searched))})")
    linear_attention = student_of("attention.linear_attention")  # a measurement needs the kernel written
    if not measurable_here(partial_credit, "run the crossover search on"):
        return
    found = crossover_seq(linear_attention)
    if not -CROSSOVER_STEPS_BELOW <= math.log2(seq / found) <= CROSSOVER_STEPS_ABOVE:
        raise WrongAnswer(f"linear_attention_crossover_seq: you wrote {seq:g}, the grader's search found {found} "
                          "(your linear_attention_chunked against torch's causal flash, forward and backward, "
                          f"bfloat16, batch 4, 16 heads, head size 128); the answer must lie from {found >> 2} to "
                          f"{found * 2}")


def test_dsa_attended_fraction(sheet):
    check_derived(sheet, "dsa_attended_fraction", capped_pairs(32768, 2048) / causal_pairs(32768), rel_tol=0.001)


def test_mla_cache_ratio(sheet):
    heads, head_dim, latent, rope = 128, 128, 512, 64
    # Per token and layer: a key and a value per head, against one latent and one shared RoPE key (same dtype).
    check_derived(sheet, "mla_cache_ratio", 2 * heads * head_dim / (latent + rope), rel_tol=0.001)
