"""Grading parallel.analysis: the parallel training family's analysis questions, read from the student's answer
sheet.

Every answer here is derived, the same on any machine: the grader derives each from the question's numbers, as
written out below, with the conventions the family's contracts pin (parallel.accounting's bytes per parameter and
communication volume, parallel.pipeline's schedules).
"""

from __future__ import annotations

from grader.checks.answers import check_derived

PARAMETERS, RANKS, GIB = 7e9, 64, 2**30
# bf16 parameter and gradient, fp32 master parameter and Adam's two moments.
PARAMETER_BYTES, GRADIENT_BYTES, OPTIMIZER_BYTES = 2, 2, 12


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
    least = next(m for m in range(1, 10_000) if (stages - 1) / (m + stages - 1) < 0.05)
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
