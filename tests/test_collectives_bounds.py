"""parallel.collectives is graded on lower as well as upper bounds of the bytes each rank sends and receives through
point-to-point calls, and the process group's store is the grader's alone.

The bounds are tested directly on per-rank counts: those of the reference's algorithms and of other honest ones pass,
counts one byte below a lower bound fail naming the rank and the bound, and every lower bound leaves room under the
upper ones. A rank is tested for what its code can find of the store. A hostile implementation carries every
collective through the store, with the right values, by torch's private route: the source policy refuses that one
line, and graded with the policy off, so that the run-time bounds are what is tested, it loses every test graded on
bytes, on the lower bounds, while moe.router, graded beside it, keeps its marks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grader.checks.outcomes import WrongAnswer
from grader.parallel.test_collectives import byte_bounds, check_bytes
from grader.ranks.launcher import LocalLauncher, RankJob
from grader.sandbox import isolation, source_policy
from grader.session.packages import resolve
from tests.grading import ROOT, assert_fails_for, run_grader

HOSTILE = Path(__file__).resolve().parent / "hostile"
WORLD_SIZE = 4
# One case of each collective on four ranks: 10 float32 elements (B = 40 bytes; chunks of 3, 3, 2 and 2 elements,
# 12, 12, 8 and 8 bytes), roots at rank 1, all_to_all's pieces one column wide with rows[i][j] from rank i to rank j.
CASES = {
    name: {"collective": name, "dtype": "float32", "shape": [10], "seed": 0, "root": 1, "op": "sum"}
    for name in ("broadcast", "scatter", "gather", "reduce", "all_gather", "reduce_scatter", "all_reduce")
}
CASES["all_to_all"] = {"collective": "all_to_all", "dtype": "float32", "seed": 0, "width": 1,
                       "split_sizes": [[1, 2, 0, 1], [0, 1, 3, 1], [2, 0, 1, 1], [1, 1, 1, 0]]}
# (collective, bytes sent by ranks 0-3, bytes received by ranks 0-3) of honest algorithms: the reference's, as its
# ranks record them (binomial trees rooted at rank 1, direct scatter and gather, rings, a direct all-to-all), then
# others a student may write.
HONEST = {
    "reference broadcast, binomial tree": ("broadcast", [0, 80, 0, 40], [40, 0, 40, 40]),
    "reference reduce, binomial tree": ("reduce", [40, 0, 40, 40], [0, 80, 0, 40]),
    "reference scatter": ("scatter", [0, 120, 0, 0], [40, 0, 40, 40]),
    "reference gather": ("gather", [40, 0, 40, 40], [0, 120, 0, 0]),
    "reference all_gather, ring": ("all_gather", [120] * 4, [120] * 4),
    "reference reduce_scatter, ring": ("reduce_scatter", [28, 28, 32, 32], [32, 28, 28, 32]),
    "reference all_reduce, ring": ("all_reduce", [56, 60, 64, 60], [60, 56, 60, 64]),
    "reference all_to_all, direct": ("all_to_all", [12, 16, 12, 12], [12, 12, 16, 12]),
    "linear broadcast": ("broadcast", [0, 120, 0, 0], [40, 0, 40, 40]),
    "linear reduce": ("reduce", [40, 0, 40, 40], [0, 120, 0, 0]),
    "direct reduce_scatter": ("reduce_scatter", [28, 28, 32, 32], [36, 36, 24, 24]),
}
# The tests of parallel.collectives graded on bytes: every collective's, and the process groups'.
BYTES_GRADED = ("test_collective[broadcast-", "test_collective[scatter-", "test_collective[gather-",
                "test_collective[reduce-", "test_collective[all_gather-", "test_collective[reduce_scatter-",
                "test_collective[all_reduce-", "test_collective[all_to_all-", "test_process_groups")


@pytest.mark.parametrize("algorithm", HONEST)
def test_honest_algorithms_pass(algorithm):
    collective, sent, received = HONEST[algorithm]
    check_bytes(CASES[collective], WORLD_SIZE, sent, received, algorithm)


@pytest.mark.parametrize("collective", CASES)
def test_data_carried_outside_point_to_point_fails(collective):
    with pytest.raises(WrongAnswer, match="received 0 bytes through point-to-point calls, below the lower bound"):
        check_bytes(CASES[collective], WORLD_SIZE, [0] * WORLD_SIZE, [0] * WORLD_SIZE, "through the store")


@pytest.mark.parametrize("collective", CASES)
def test_one_byte_below_a_lower_bound_fails(collective):
    """The lower bounds themselves pass; one byte fewer, sent or received by any rank with a bound, fails naming the
    rank, the bytes and the bound."""
    bounds = byte_bounds(CASES[collective], WORLD_SIZE)
    least = {"sent": bounds.least_sent, "received": bounds.least_received}
    check_bytes(CASES[collective], WORLD_SIZE, least["sent"], least["received"], "at the bounds")
    for direction, bound_of_rank in least.items():
        for rank, bound in enumerate(bound_of_rank):
            if bound == 0:
                continue
            counts = {key: list(values) for key, values in least.items()}
            counts[direction][rank] -= 1
            with pytest.raises(WrongAnswer, match=f"rank {rank} {direction} {bound - 1} bytes through point-to-point "
                                                  f"calls, below the lower bound of {bound}: "):
                check_bytes(CASES[collective], WORLD_SIZE, counts["sent"], counts["received"], "one byte short")


@st.composite
def drawn_cases(draw) -> tuple[dict, int]:
    world_size = draw(st.integers(1, 8))
    collective = draw(st.sampled_from(sorted(CASES)))
    case = {"collective": collective, "dtype": draw(st.sampled_from(["float32", "int64"])),
            "shape": draw(st.lists(st.integers(1, 9), min_size=1, max_size=2)),
            "root": draw(st.integers(0, world_size - 1))}
    if collective == "all_to_all":
        rows = st.lists(st.integers(0, 5), min_size=world_size, max_size=world_size)
        case.update(width=draw(st.integers(1, 9)),
                    split_sizes=draw(st.lists(rows, min_size=world_size, max_size=world_size)))
    return case, world_size


@given(drawn_cases())
def test_lower_bounds_leave_room_under_the_upper_ones(drawn):
    """Every rank can meet its lower bounds within its upper bound, and every byte the ranks must receive fits in
    what they may send."""
    case, world_size = drawn
    bounds = byte_bounds(case, world_size)
    most_per_rank = bounds.most_sent or [bounds.most_sent_in_all] * world_size
    assert all(least <= most for least, most in zip(bounds.least_sent, most_per_rank))
    most_in_all = bounds.most_sent_in_all if bounds.most_sent_in_all is not None else sum(bounds.most_sent)
    assert max(sum(bounds.least_sent), sum(bounds.least_received)) <= most_in_all


def test_rank_code_finds_no_store(monkeypatch):
    """After the student's module is imported, code in a rank finds no store address in its environment (even where
    the grader's own holds one), get_group_store refuses, and no file it can list holds the store."""
    works, why = isolation.bwrap_works()
    if not works:
        pytest.fail(f"no bwrap sandbox here, and the store's folder is unlisted only to a sandboxed rank: {why}")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    reference = resolve(str(ROOT / "reference"))
    job = RankJob(problem="parallel.collectives", impl=reference, reference=reference,
                  program="tests.rank_programs:what_rank_code_sees_of_the_store", world_size=2, backend="gloo",
                  isolation="bwrap", disable_userns=isolation.Isolation("none").disable_userns,
                  extra_code=(str(ROOT / "tests"),))
    for seen in LocalLauncher().run(job):
        assert seen["environment"] == {}
        assert "belongs to the grader's setup" in seen["get_group_store"]
        assert seen["files_holding_the_store"] == []


def test_collectives_through_the_store_lose_their_points(tmp_path):
    impl = tmp_path / "impl"
    shutil.copytree(ROOT / "reference", impl, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(HOSTILE / "collectives_through_store" / "parallel" / "collectives.py",
                impl / "parallel" / "collectives.py")
    refused = [str(v) for v in source_policy.violations("impl", impl, "parallel.collectives")]
    assert len(refused) == 1 and "_get_default_store" in refused[0], refused
    run = run_grader(impl, "--problem", "parallel.collectives,moe.router", "--source-policy", "off",
                     "-k", "test_collectives or indices_and_gates")
    for test in BYTES_GRADED:
        assert_fails_for(run, "parallel.collectives", test, "received 0 bytes through point-to-point calls",
                         "below the lower bound of")
    passed = [t["name"] for t in run.tests_of("parallel.collectives") if t["status"] == "passed"]
    assert passed == ["parallel.collectives :: test_invalid_arguments"], passed
    router = run.tests_of("moe.router")
    assert router and all(t["status"] == "passed" for t in router), run.output[-3000:]
