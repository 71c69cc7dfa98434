"""The parallel analysis section's self-check: its answers recomputed from the reference's accounting and pipeline
functions, the ring's bytes measured on the reference's collectives and the step times on the pipeline test's
simulation of a schedule; each printed answer is also looked up in the section. Its questions use other numbers than
the graded ones, so nothing here is an answer of the sheet."""

from pathlib import Path

import pytest

from reference.parallel.accounting import bytes_per_parameter, communication_volume
from reference.parallel.pipeline import bubble_fraction
from tests.test_handout_pipeline import simulate
from tests.thread_ranks import bytes_sent_per_rank

SECTION = Path(__file__).resolve().parents[1] / "assignment/handout/sections/parallel/analysis.typ"


def assert_printed(*strings):
    text = " ".join(SECTION.read_text().split())
    for printed in strings:
        assert printed in text, printed


def test_zero3_gib_and_gb():
    per_rank = bytes_per_parameter("zero3", 8).total * 10**9
    assert per_rank == 2e9
    assert round(per_rank / 2**30, 3) == 1.863
    assert_printed("(1) $2 dot 10^9$ bytes: $1.863$ GiB or 2 GB, 7~% apart")


def test_least_micro_batches_for_a_bubble_below_ten_percent():
    least = next(m for m in range(1, 1000) if bubble_fraction(4, m) < 0.1)
    assert least == 28
    assert bubble_fraction(4, 27) == 0.1
    assert_printed("(2) $m = 28$", "$m = 27$ gives exactly 10~%, not below")


def test_ring_all_reduce_bytes(monkeypatch):
    # Measured: a ring all-reduce of 16 float32 values (64 bytes) on 4 ranks, scaled to 256 MiB.
    measured = bytes_sent_per_rank(monkeypatch, "all_reduce", 4, 16) * 2**28 // 64
    assert communication_volume("all_reduce", 256 * 2**20, 4) == measured == 402_653_184
    assert_printed("(3) $2 dot 3 slash 4 dot 2^28 = 402 thin 653 thin 184$")


def test_two_stage_step_times():
    p, m, tf, tb = 2, 4, 40, 80
    orders, _, step = simulate("gpipe", p, m, tf, tb)
    busy = sum(tf if kind == "F" else tb for kind, _ in orders[0])  # each stage's work
    assert step == 600 and 1 - busy / step == pytest.approx(bubble_fraction(p, m)) == 0.2
    serial = p * busy  # stage 1 starts only when stage 0 has finished the whole batch
    assert busy == 480 and serial == 960 and 1 - busy / serial == 0.5
    assert_printed("$(m + p - 1)(t_f + t_b) = 600$ ms, bubble 0.2", "480 ms each run one after the other, 960 ms",
                   "bubble $1 - 1 slash p = 0.5$")
