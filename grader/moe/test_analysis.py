"""Grading moe.analysis: the mixture-of-experts family's analysis questions, read from the student's answer sheet.

Every answer here is derived, the same on any machine: the grader derives each from the question's numbers, as
written out below, with the conventions the family's contracts pin.
"""

from __future__ import annotations

import math

from grader.checks.answers import check_derived
from grader.moe.test_accounting import DEEPSEEK_V3_SHAPES_COUNTS, with_totals

TOKENS, TOP_K, EXPERTS, CAPACITY_FACTOR = 4096, 2, 64, 1.25


def capacity() -> int:
    # moe.capacity's rule.
    return math.ceil(CAPACITY_FACTOR * TOKENS * TOP_K / EXPERTS)


def test_capacity_slots(sheet):
    check_derived(sheet, "capacity_slots", capacity())


def test_capacity_dropped(sheet):
    # Expert 0 receives every token's first choice and keeps `capacity` of them; the second choices, spread evenly
    # over the other 63 experts, come to at most ceil(4096 / 63) = 66 each, within their capacity.
    check_derived(sheet, "capacity_dropped", TOKENS - capacity())


def test_balance_loss_two_experts(sheet):
    experts = 8
    routed_fraction = [0.5, 0.5]  # f_i: half of all routing slots to each of experts 0 and 1
    mean_probability = [0.5, 0.5]  # P_i
    loss = experts * sum(f * p for f, p in zip(routed_fraction, mean_probability))
    check_derived(sheet, "balance_loss_two_experts", loss, rel_tol=0.001)


def test_activated_fraction(sheet):
    counts = with_totals(DEEPSEEK_V3_SHAPES_COUNTS)
    check_derived(sheet, "activated_fraction", counts["activated"] / counts["total"], rel_tol=0.005)
