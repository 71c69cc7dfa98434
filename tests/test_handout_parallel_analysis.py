"""The parallel analysis section's self-check: its answers recomputed from the reference's accounting and pipeline
functions. Its questions use other numbers than the graded ones, so nothing here is an answer of the sheet."""

import pytest

from reference.parallel.accounting import bytes_per_parameter, communication_volume
from reference.parallel.pipeline import bubble_fraction


def test_zero3_gib_and_gb():
    per_rank = bytes_per_parameter("zero3", 8).total * 10**9
    assert per_rank == 2e9
    assert round(per_rank / 2**30, 3) == 1.863
    assert round(2**30 / 10**9 - 1, 2) == 0.07


def test_least_micro_batches_for_a_bubble_below_ten_percent():
    least = next(m for m in range(1, 1000) if bubble_fraction(4, m) < 0.1)
    assert least == 28
    assert bubble_fraction(4, 27) == 0.1


def test_ring_all_reduce_bytes():
    assert communication_volume("all_reduce", 256 * 2**20, 4) == 2 * 3 / 4 * 2**28 == 402_653_184


def test_two_stage_step_times():
    p, m, tf, tb = 2, 4, 40, 80
    overlapped = (m + p - 1) * (tf + tb)
    assert overlapped == 600 and 1 - m * (tf + tb) / overlapped == pytest.approx(bubble_fraction(p, m)) == 0.2
    serial = p * m * (tf + tb)  # each stage's 480 ms, one stage after the other
    assert m * (tf + tb) == 480 and serial == 960 and 1 - m * (tf + tb) / serial == 1 - 1 / p == 0.5
