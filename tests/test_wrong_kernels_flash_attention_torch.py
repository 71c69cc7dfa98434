"""The grader fails each deliberately wrong kernels.flash_attention_torch, and its message names the fault.

Each variant in tests/wrong/kernels_flash_attention_torch/ is a plausible tiled PyTorch FlashAttention with one bug.
Each run selects only the test that bug must fail.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "kernels.flash_attention_torch"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("dq_ignores_causal_mask", "causal", "gradient of q", "out of tolerance", "is_causal=True"),
    case("no_rescale", "forward", "output o of flash_attention", "out of tolerance"),
    case("saves_probabilities", "saves_no_score_matrix", "saved a tensor of shape", "n x n matrix"),
    # Shrinking ends at seq = 1, below one whole tile: no key is seen at all and 0/0 gives NaN.
    case("drops_last_key_block", "forward", "output o of flash_attention", "non-finite"),
    case("lse_missing_max", "logsumexp", "logsumexp L (the fifth saved tensor)", "out of tolerance"),
    case("scale_one_over_d", "forward", "output o of flash_attention", "out of tolerance"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_flash_attention_torch(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"kernels_flash_attention_torch and test_{test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
