"""The grader fails each deliberately wrong parallel.ddp, and its message names the fault.

Each variant in tests/wrong/parallel_ddp/ is a plausible student DDP with one bug. Each run selects only the 2-rank
test that bug must fail: a rank launch costs seconds, and a failure is shrunk by replaying launches.
"""

from __future__ import annotations

import uuid

import pytest

from assignment.registry import BY_ID
from tests.grading import assert_fails_for, processes_with, run_grader, wrong_impl

PROBLEM = "parallel.ddp"


def case(variant: str, test: str, *fragments: str, any_of: tuple[str, ...] = ()):
    """The grader's `test` must fail for `variant`, its output containing every fragment and one of `any_of`."""
    return pytest.param(variant, test, fragments, any_of, id=variant)


CASES = [
    case("sums_gradients", "matches_single_process[2]", "gradient after step 1", "out of tolerance"),
    case("rank0_gradients_only", "matches_single_process[2]", "gradient after step 1", "out of tolerance"),
    case("one_allreduce_after_backward", "overlaps_backward[2]", "issued after backward returned"),
    case("no_broadcast", "broadcast_at_construction[2]", "on rank 1 differs from rank 0's", "broadcast from rank 0"),
    case("no_buffer_broadcast", "broadcast_at_construction[2]", "buffer 0 on rank 1 differs from rank 0's"),
    # Two async all-reduces of one gradient tensor race on gloo's worker threads: the values come out wrong, or, if
    # the two happen to run one after the other, right, and then only the count of all-reduces gives the bug away.
    case("hooks_every_tied_use", "tied_weights[2]", any_of=("out of tolerance", "a tied weight is one parameter")),
    case("grad_for_frozen", "frozen_parameter[2]", "frozen parameter", "must stay None"),
    case("uses_torch_ddp", "broadcast_at_construction[2]", "ForbiddenModuleUsed",
         "torch.nn.parallel.DistributedDataParallel may not be used"),
    # Rank 1 exits while rank 0 still waits in the all-reduce it skipped: rank 0's collective fails at once.
    case("rank1_skips_last_all_reduce", "broadcast_at_construction[2]", "rank 0 of 2 raised",
         "the ranks disagree on collectives", "rank(s) [1] never arrived"),
]


@pytest.mark.parametrize("variant, test, fragments, any_of", CASES)
def test_grader_fails_wrong_ddp(variant, test, fragments, any_of):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"parallel_ddp and {test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
    if any_of:
        outputs = [t["output"].lower() for t in run.failures(PROBLEM)]
        assert any(f.lower() in out for f in any_of for out in outputs), f"none of {any_of} in:\n{outputs}"


# The launcher's deadline ends a hang; scaled down so the test waits seconds, not the problem's full call limit.
TIMEOUT_SCALE = 0.2


def test_a_rank_that_never_joins_an_all_reduce_times_out():
    marker = f"DDP_HANG_TEST={uuid.uuid4().hex}"
    name, _, value = marker.partition("=")
    run = run_grader(
        wrong_impl(PROBLEM, "rank1_skips_all_reduce"),
        "-k", "parallel_ddp and broadcast_at_construction[2]", "--timeout-scale", str(TIMEOUT_SCALE),
        env={name: value},
    )
    limit_s = BY_ID[PROBLEM].call_timeout_s * TIMEOUT_SCALE
    assert_fails_for(
        run, PROBLEM, "broadcast_at_construction[2]",
        f"did not finish within {limit_s:.0f} s", "rank(s) [0] waited in collective", "(all_reduce)",
        "rank(s) [1] never arrived",
        status="timed out",
    )
    assert processes_with(marker) == [], "rank processes outlived the grader run"
