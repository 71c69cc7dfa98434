"""The grader fails each deliberately wrong parallel.expert_parallel, and its message names the fault.

Each variant in tests/wrong/parallel_expert_parallel/ is a plausible student MoE layer with one bug; each run selects
only the 2-rank test that bug must fail.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "parallel.expert_parallel"

CASES = [
    pytest.param("combine_with_sort_order", "matches_single_rank[2]", ("output y_TD", "out of tolerance"),
                 "failed", id="combine_with_sort_order"),
    pytest.param("gates_twice", "matches_single_rank[2]", ("output y_TD", "out of tolerance"), "failed",
                 id="gates_twice"),
    # On gloo, receiving more rows than the split sizes say aborts the receiving rank inside all_to_all_single.
    pytest.param("symmetric_counts", "uneven_and_empty_experts[2]",
                 ("rank 1 of 2 died", "in all_to_all_single"), "crashed", id="symmetric_counts"),
    pytest.param("gather_everything", "uses_all_to_all[2]",
                 ("the collectives of forward moved", "all_gather", "send each token only to the ranks of its experts"),
                 "failed", id="gather_everything"),
]


@pytest.mark.parametrize("variant, test, fragments, status", CASES)
def test_grader_fails_wrong_expert_parallel(variant, test, fragments, status):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"parallel_expert_parallel and {test}")
    assert_fails_for(run, PROBLEM, test, *fragments, status=status)
