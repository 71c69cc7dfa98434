"""The grader fails each deliberately wrong parallel.collectives, and its message names the fault.

Each variant in tests/wrong/parallel_collectives/ is a plausible student module with one bug. Each run selects only
the test that bug must fail, at the world size where it shows: a rank launch costs seconds. That the reference passes
every test is checked by the full reference run of tests/test_self_check.py (a second run here would double this
problem's CI time).
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "parallel.collectives"


def case(variant: str, test: str, *fragments: str):
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("all_reduce_double_counts_a_chunk", "all_reduce[2]", "all_reduce's result on rank", "values differ"),
    # Right values; with four ranks rank 0 sends 3 B where a ring sends 1.5 B.
    case("all_reduce_through_rank0", "all_reduce[4]", "rank 0 sent", "more than the", "a ring all-reduce sends"),
    case("reduce_scatter_wrong_chunk", "reduce_scatter[4]", "reduce_scatter's result on rank", "values differ"),
    case("all_to_all_swapped_pieces", "all_to_all[4]", "all_to_all's result on rank", "tensor 1 of the list"),
    case("all_reduce_with_dist_all_reduce", "all_reduce[2]", "called torch.distributed.all_reduce",
         "from send, recv, isend, irecv and batch_isend_irecv only"),
    # The same shortcut beneath torch.distributed's functions: the process group's method, the functional collectives.
    case("all_reduce_with_process_group", "all_reduce[2]", "called torch.distributed.ProcessGroup.allreduce"),
    case("all_gather_with_functional_collectives", "all_gather[2]",
         "called torch.distributed._functional_collectives.all_gather_tensor"),
    case("broadcast_ignores_group", "process_groups", "in the group of global ranks",
         "broadcast's result on rank", "values differ"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_collectives(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"parallel_collectives and {test}")
    assert_fails_for(run, PROBLEM, test, *fragments)

