"""Grading parallel.analysis: the parallel training family's analysis questions, read from the student's answer
sheet.

Derived answers are the same on any machine: the grader derives each from the question's numbers, as written out
below, with the conventions the family's contracts pin (parallel.accounting's bytes per parameter and communication
volume, parallel.pipeline's schedules). Two are measured, each on the student's own code and again by the grader:
- the bubble of pipeline_step, as grader.parallel.bubble describes;
- bucketed DDP's step time at four bucket sizes, as grader.parallel.bucket_time describes.
The work of both is a sleep and their communication runs on the CPU (the second over a simulated link of fixed
latency and bandwidth), so the measurements are the same on any machine, GPU or not, up to a few percent of overhead.
"""

from __future__ import annotations

from grader.checks.answers import check_derived, number
from grader.checks.outcomes import WrongAnswer
from grader.parallel import bucket_time, link
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
# The measured step time of bucketed DDP over 2 ranks, at bucket limits of 1, 2, 4 and 8 layers' gradients. A 2-core
# CPU host measures within 10 ms of the link's model (224, 208, 238 and 299 ms for the reference), so STEP_REL_TOL
# leaves room for a busier machine while an implementation that issues its all-reduces late misses by 15 % or more.
BUCKET_RANKS, BUCKET_SIZES_MB = 2, {"0_25mb": 0.25, "0_5mb": 0.5, "1mb": 1, "2mb": 2}
STEP_REL_TOL = 0.10
LAYERS_BACKWARD_MS = bucket_time.LAYERS * bucket_time.BACKWARD_S * 1e3


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


def test_measured_bucket_step_time(sheet, ranks_of):
    keys = [f"ddp_step_ms_bucket_{name}" for name in BUCKET_SIZES_MB]
    written = {key: number(sheet, key) for key in keys}
    for key, value in written.items():
        if value < LAYERS_BACKWARD_MS:
            raise WrongAnswer(f"{key}: the backward alone sleeps {LAYERS_BACKWARD_MS:g} ms, so a step takes longer "
                              f"than that, not {value:g} ms (written in seconds?)")
    ddp = ranks_of("parallel.ddp_bucketed")  # a measurement needs bucketed DDP written
    measured = bucket_time.measured_step_ms(ddp, BUCKET_RANKS, list(BUCKET_SIZES_MB.values()))
    misses = [f"{key}: you wrote {value:g} ms, the grader measured {step_ms:.0f} ms"
              for (key, value), step_ms in zip(written.items(), measured, strict=True)
              if abs(value - step_ms) > STEP_REL_TOL * step_ms]
    if misses:
        raise WrongAnswer(
            f"{'; '.join(misses)} (your BucketedDDP on {BUCKET_RANKS} ranks over the simulated link: "
            f"{bucket_time.LAYERS} layers of 0.25 MiB whose backward sleeps {bucket_time.BACKWARD_S * 1e3:g} ms each, "
            f"all-reduces of {link.LATENCY_S * 1e3:g} ms plus {link.SECONDS_PER_BYTE * 2**20 * 1e3:g} ms per MiB); "
            f"an answer must be within {STEP_REL_TOL:.0%} of the grader's measurement")
