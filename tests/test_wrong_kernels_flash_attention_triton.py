"""The grader fails each deliberately wrong kernels.flash_attention_triton, and its message names the fault.

Each variant in tests/wrong/kernels_flash_attention_triton/ is a plausible FlashAttention in Triton with one bug.
Each run selects only the test that bug must fail, so the whole module stays short under Triton's interpreter.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "kernels.flash_attention_triton"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("dq_ignores_causal_mask", "causal", "gradient of q", "out of tolerance", "is_causal=True"),
    case("no_rescale", "forward_fp32", "output o of flash_attention", "out of tolerance"),
    case("saves_scores", "saves_no_score_matrix", "saved a tensor of shape", "n x n matrix"),
    # Shrinking ends at seq = 1, below one whole block: no key is seen at all and 0/0 gives NaN.
    case("drops_last_key_block", "forward_fp32", "output o of flash_attention", "non-finite"),
    case("lse_missing_max", "logsumexp", "logsumexp L (the fifth saved tensor)", "out of tolerance"),
    case("scale_one_over_d", "forward_fp32", "output o of flash_attention", "out of tolerance"),
    case("backward_in_pytorch", "backward", "the backward of flash_attention launched no Triton kernel"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_flash_attention_triton(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"kernels_flash_attention_triton and test_{test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
