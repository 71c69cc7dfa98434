"""The grader fails each deliberately wrong moe.upcycle for its fault.

Each variant in tests/wrong/moe_upcycle/ is a plausible student upcycling with one bug. Each run selects only the
test that bug must fail.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "moe.upcycle"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("shared_storage", "experts_independent", "not independent copies", "changed the dense"),
    case("down_reshaped", "expert_copies", "down_proj_EDH", "values differ"),
    case("no_renormalisation", "matches_dense", "differs from the dense", "normalize_topk=False"),
    case("down_divided_by_experts", "matches_dense", "differs from the dense"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_upcycle(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"moe_upcycle and test_{test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
