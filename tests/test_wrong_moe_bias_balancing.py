"""The grader fails each deliberately wrong moe.bias_balancing for its fault.

Each variant in tests/wrong/moe_bias_balancing/ is a plausible student update with one bug. Each run selects only
the test that bug must fail.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "moe.bias_balancing"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("sign_flipped", "bias_update", "expert_bias_E", "values differ"),
    case("mean_load_lowered", "experts_at_the_mean", "expert_bias_E", "values differ", "cyclic"),
    case("step_by_load_error", "bias_update", "expert_bias_E", "values differ"),
    case("centred_update", "bias_update", "expert_bias_E", "values differ"),
    case("loads_without_bias", "loads", "tokens_per_expert_E", "values differ"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_bias_balancing(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"moe_bias_balancing and test_{test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
