"""The grader fails each deliberately wrong parallel.sequence_parallel, and its message names the fault.

Each variant in tests/wrong/parallel_sequence_parallel/ is a plausible student implementation with one bug. Each run
selects only the 2-rank test that bug must fail: a rank launch costs seconds.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "parallel.sequence_parallel"


def case(variant: str, test: str, *fragments: str):
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    # Values stay right; only the collectives show that every rank received the whole sequence's sum.
    case("all_reduce_instead_of_reduce_scatter", "collective_pattern[2]", "one forward of the block issued",
         "all_reduce of 96 bytes", "no all-reduce"),
    case("norm_grads_not_all_reduced", "block_matches_single_rank[2]", "gradient of norm.bias", "out of tolerance"),
    case("forgets_row_bias_grad", "block_matches_single_rank[2]", "gradient of fc2.bias", "out of tolerance"),
    # The block acts token by token, so gathering and scattering along the batch gives it the right values: only the
    # collectives graded on their own show the wrong dimension.
    case("gathers_batch_dim", "gather_and_reduce_scatter[2]", "gather_sequence output", "wrong shape (4, 2, 3)"),
    case("dropout_mask_from_local_shard", "dropout_matches_single_rank[2]", "output (this rank's tokens)",
         "out of tolerance", "dropout_p=0.5"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_sequence_parallel(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"parallel_sequence_parallel and {test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
