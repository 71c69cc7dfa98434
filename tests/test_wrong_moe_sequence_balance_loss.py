"""The grader fails each deliberately wrong moe.sequence_balance_loss for its fault.

Each variant in tests/wrong/moe_sequence_balance_loss/ is a plausible student implementation with one bug. Each run
selects only the test that bug must fail.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "moe.sequence_balance_loss"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    # Pooling the batch only matters with several sequences: the shrunk failing case has B > 1.
    case("whole_batch", "loss", "loss", "out of tolerance"),
    case("load_without_num_experts", "even_routing", "loss", "out of tolerance", "routing=even"),
    case("unnormalised_affinities", "even_routing", "loss", "out of tolerance", "routing=even"),
    case("normaliser_detached", "gradients", "gradient of affinity_logits_BTE", "out of tolerance"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_sequence_balance_loss(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"moe_sequence_balance_loss and test_{test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
