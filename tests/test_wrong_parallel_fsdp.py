"""The grader fails each deliberately wrong parallel.fsdp for its fault.

Each variant in tests/wrong/parallel_fsdp/ is a plausible student FSDP with one bug. Each run selects only the 2-rank
test that bug must fail: a rank launch costs seconds.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "parallel.fsdp"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("keeps_gathered_after_forward", "peak_parameter_memory[2]", "bytes held above the step's start",
         "free each unit's gathered parameters after its forward"),
    case("reuses_forward_gather", "collective_pattern[2]", "all-gathers during backward moved [] bytes",
         "expected one per unit"),
    case("sums_gradients", "matches_single_process[2]", "gradient shard of unit block0 in step 1", "out of tolerance"),
    case("state_dict_local_shard", "full_state_dict[2]", "full_state_dict()[", "wrong shape"),
    case("accepts_tied_weights", "tied_weights_rejected[2]", "must raise ValueError", "it returned normally"),
    case("gathers_in_float32", "compute_dtype_bf16[2]", "all-gathers during forward moved",
         "in the compute dtype"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_fsdp(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"parallel_fsdp and {test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
