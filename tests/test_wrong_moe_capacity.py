"""The grader fails each deliberately wrong moe.capacity for its fault.

Each variant in tests/wrong/moe_capacity/ is a plausible student implementation with one bug. Each run selects only
the test that bug must fail.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "moe.capacity"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("capacity_rounded_down", "capacity", "capacity: got", "expected", "ceil("),
    case("token_major_priority", "kept_set", "kept_TK", "values differ"),
    case("dropped_rerouted", "kept_set", "kept_TK", "values differ"),
    case("renormalised_gates", "gates", "gate_TK", "values differ"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_capacity(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"moe_capacity and test_{test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
