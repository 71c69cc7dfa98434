"""The grader fails each deliberately wrong moe.expert_choice for its fault.

Each variant in tests/wrong/moe_expert_choice/ is a plausible student implementation with one bug. Each run selects
only the test that bug must fail.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "moe.expert_choice"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("softmax_over_tokens", "tokens_and_gates", "gate_EC"),
    case("capacity_rounded_up", "capacity", "token_index_EC: shape", "floor("),
    case("ranked_by_logits", "tokens_and_gates", "token_index_EC", "values differ"),
    case("ties_to_highest_index", "tie_breaking", "token_index_EC", "values differ"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_expert_choice(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"moe_expert_choice and test_{test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
