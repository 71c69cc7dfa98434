"""Grading parallel.analysis: the parallel training family's analysis questions, read from the student's answer
sheet.

Derived answers are the same on any machine: the grader derives each from the question's numbers, as written out
below, with the conventions the family's contracts pin (parallel.accounting's bytes per parameter and communication
volume, parallel.pipeline's schedules). One answer is measured: the bubble of the student's own pipeline_step, which
the grader measures again as grader.parallel.bubble describes. Its stages' work is a sleep and it runs over gloo on
the CPU, so its measurement is the same on any machine, GPU or not, up to a point or two of overhead.
"""

from __future__ import annotations

from grader.checks.answers import check_derived, number
from grader.checks.outcomes import WrongAnswer
from grader.parallel.bubble import BACKWARD_S, FORWARD_S, ideal_bubble, measured_bubbles

PARAMETERS, RANKS, GIB = 7e9, 64, 2**30
# bf16 parameter and gradient, fp32 master parameter and Adam's two moments.
PARAMETER_BYTES, GRADIENT_BYTES, OPTIMIZER_BYTES = 2, 2, 12
# The measured bubble: GPipe over 4 stages of grader.parallel.bubble's sleeping layers, at each of these numbers of
# micro-batches. A machine's communication and Python overheads move a bubble by a point or two (on a 2-core CPU host,
# 0.44 and 0.17 against the 0.43 and 0.16 of free communication, the same in the grader's ranks and in a plain
# script), so an answer may lie BUBBLE_ABS_TOL from the grader's.
BUBBLE_STAGES, BUBBLE_MICRO_BATCHES = 4, (4, 16)
BUBBLE_ABS_TOL = 0.05


def test_zero_state(sheet):
    sharded = {
        "zero1_gib": PARAMETER_BYTES + GRADIENT_BYTES + OPTIMIZER_BYTES / RANKS,
        "zero2_gib": PARAMETER_BYTES + (GRADIENT_BYTES + OPTIMIZER_BYTES) / RANKS,
        "zero3_gib": (PARAMETER_BYTES + GRADIENT_BYTES + OPTIMIZER_BYTES) / RANKS,
    }
    for key, bytes_per_parameter in sharded.items():
        check_derived(sheet, key, PARAMETERS * bytes_per_parameter / GIB, rel_tol=0.005)


def test_micro_batches_for_bubble(sheet):
    stages = 8
    least = next(m for m in range(1, 10_000) if ideal_bubble(stages, m) < 0.05)
    check_derived(sheet, "micro_batches_for_bubble", least)


def test_peak_micro_batches(sheet):
    stages, micro_batches = 4, 12
    # GPipe runs every forward before any backward; 1F1B's stage 0 runs p - 1 warm-up forwards and one more before
    # its first backward frees one.
    check_derived(sheet, "peak_micro_batches_gpipe", micro_batches)
    check_derived(sheet, "peak_micro_batches_1f1b", min(stages, micro_batches))


def test_ring_all_reduce_bytes(sheet):
    bucket, ranks = GIB, 8
    # A reduce-scatter then an all-gather, each sending (N - 1) chunks of bucket / N per rank.
    check_derived(sheet, "ring_all_reduce_bytes", 2 * (ranks - 1) * bucket // ranks)


def test_measured_bubble(sheet, ranks_of):
    written = {}
    for micro_batches in BUBBLE_MICRO_BATCHES:
        key = f"measured_bubble_m{micro_batches}"
        written[key] = number(sheet, key)
        if not 0 <= written[key] < 1:
            raise WrongAnswer(f"{key}: a bubble is the fraction of the step a stage idles, from 0 to 1, not "
                              f"{written[key]:g}")
    pipeline = ranks_of("parallel.pipeline")  # a measurement needs the pipeline written
    cases = [("gpipe", micro_batches) for micro_batches in BUBBLE_MICRO_BATCHES]
    for (key, value), bubble in zip(written.items(), measured_bubbles(pipeline, BUBBLE_STAGES, cases), strict=True):
        if abs(value - bubble) > BUBBLE_ABS_TOL:
            raise WrongAnswer(f"{key}: you wrote {value:.3f}, the grader measured {bubble:.3f} (your pipeline_step, "
                              f"GPipe over {BUBBLE_STAGES} stages whose forward sleeps {FORWARD_S * 1e3:g} ms and "
                              f"backward {BACKWARD_S * 1e3:g} ms, on gloo); the answer must be within {BUBBLE_ABS_TOL} "
                              "of the grader's measurement")
