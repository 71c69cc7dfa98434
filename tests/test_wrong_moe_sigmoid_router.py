"""The grader fails each deliberately wrong moe.sigmoid_router for its fault.

Each variant in tests/wrong/moe_sigmoid_router/ is a plausible student router with one bug. Each run selects only
the test that bug must fail.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "moe.sigmoid_router"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("bias_in_gates", "indices_and_gates", "gate_TK", "out of tolerance", "bias std"),
    case("softmax_affinities", "indices_and_gates", "gate_TK", "out of tolerance"),
    case("no_renormalisation", "indices_and_gates", "gate_TK", "out of tolerance"),
    case("route_scale_ignored", "indices_and_gates", "gate_TK", "out of tolerance", "route_scale="),
    case("ties_to_highest_index", "tie_breaking", "expert_index_TK", "values differ", "integers"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_sigmoid_router(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"moe_sigmoid_router and test_{test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
