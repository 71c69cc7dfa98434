"""Grading attention.analysis: the attention family's analysis questions, read from the student's answer sheet.

Derived answers are compared with the grader's derivation, written out below from each question's numbers. The
sliding window's speedup is measured: on a GPU the grader times the student's own sliding_window_attention beside
torch's causal flash attention as the problem's speed test does, and the answer must be within MEASURED_REL_TOL
(grader.checks.answers) of that; without a GPU it can only check that the speedup is consistent with the work saved,
and says so.
"""

from __future__ import annotations

from assignment.registry import BY_ID
from grader.attention.speed_cases import SPEEDS
from grader.checks.answers import check_baseline_over_kernel, check_derived, number
from grader.checks.marks import timed_on_gpu
from grader.checks.outcomes import WrongAnswer

# The speed test's second case: (batch, heads, seq, head_dim, window) in bfloat16.
WINDOW_CASE = (BY_ID["attention.sliding_window"].speed.shapes[1], "bfloat16")
# A kernel that skips work cannot gain much more than the work it skips.
MOST_OVER_WORK_RATIO = 1.25


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


def test_dsa_attended_fraction(sheet):
    check_derived(sheet, "dsa_attended_fraction", capped_pairs(32768, 2048) / causal_pairs(32768), rel_tol=0.001)


def test_mla_cache_ratio(sheet):
    heads, head_dim, latent, rope = 128, 128, 512, 64
    # Per token and layer: a key and a value per head, against one latent and one shared RoPE key (same dtype).
    check_derived(sheet, "mla_cache_ratio", 2 * heads * head_dim / (latent + rope), rel_tol=0.001)
