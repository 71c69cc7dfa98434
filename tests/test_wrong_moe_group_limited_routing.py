"""The grader fails each deliberately wrong moe.group_limited_routing for its fault.

Each variant in tests/wrong/moe_group_limited_routing/ is a plausible student router with one bug. Each run selects
only the test that bug must fail.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "moe.group_limited_routing"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("group_score_by_max", "groups_and_experts", "group_index_TM", "values differ"),
    case("group_score_sum_of_all", "groups_and_experts", "group_index_TM", "values differ"),
    case("strided_groups", "groups_and_experts", "group_index_TM", "values differ"),
    case("topk_over_all_experts", "groups_and_experts", "expert_index_TK", "values differ"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_group_limited_routing(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"moe_group_limited_routing and test_{test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
