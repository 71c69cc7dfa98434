"""The grader fails each deliberately wrong moe.accounting for its fault.

Each variant in tests/wrong/moe_accounting/ is a plausible student implementation with one bug. Each run selects
only the test that bug must fail.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "moe.accounting"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("two_matrix_experts", "published_shapes", "routed_experts: got", "activated_routed_experts: got"),
    case("activated_all_routed", "published_shapes", "activated: got", "expected"),
    case("activated_without_shared", "drawn_configs", "activated: got", "num_shared_experts="),
    case("tied_counted_twice", "published_shapes", "embedding: got", "tied_embeddings=True"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_accounting(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"moe_accounting and test_{test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
