"""The grader fails each deliberately wrong moe.moe_layer for its fault.

Each variant in tests/wrong/moe_moe_layer/ is a plausible student layer with one bug. Each run selects only the
test that bug must fail.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "moe.moe_layer"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("per_token_loop", "batched_dispatch", "torch operations", "not batched per expert"),
    case("shared_averaged", "output", "y_TD", "out of tolerance", "S=2"),
    case("router_detached", "gradients", "gradient of router_weight_ED", "received no gradient"),
    case("counts_skip_empty_experts", "uneven_and_empty_experts", "y_TD", "out of tolerance", "routing=skewed"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_moe_layer(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"moe_moe_layer and test_{test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
