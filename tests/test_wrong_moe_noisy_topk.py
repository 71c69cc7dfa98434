"""The grader fails each deliberately wrong moe.noisy_topk for its fault.

Each variant in tests/wrong/moe_noisy_topk/ is a plausible student gate with one bug. Each run selects only the
test that bug must fail.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "moe.noisy_topk"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("noise_in_eval", "eval_is_noise_free", "noisy_logits_TE", "out of tolerance", "training=False"),
    case("noise_scaled_by_exp", "noisy_logits", "noisy_logits_TE", "out of tolerance", "training=True"),
    case("softmax_over_all_experts", "indices_and_gates", "gate_TK", "out of tolerance"),
    case("gates_from_clean_logits", "indices_and_gates", "gate_TK", "out of tolerance", "training=True"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_noisy_topk(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"moe_noisy_topk and test_{test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
