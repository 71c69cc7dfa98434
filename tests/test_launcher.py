"""The distributed launchers: results per rank, and clear verdicts for errors, deaths and hangs."""

from __future__ import annotations

import dataclasses
import time
import uuid

import pytest
import torch

from grader.checks.outcomes import StudentCrashed, StudentError, StudentTimedOut
from grader.ranks.launcher import GroupSetupFailed, LocalLauncher, RankJob, SubmititLauncher, launch
from grader.sandbox import isolation
from grader.session.packages import resolve
from tests.grading import ROOT, processes_with


def job(program: str, world_size: int = 2, timeout_s: float = 60.0, rank_data: list | None = None) -> RankJob:
    reference = resolve(str(ROOT / "reference"))
    return RankJob(
        problem="parallel.ddp",
        impl=reference,
        reference=reference,
        program=f"tests.rank_programs:{program}",
        world_size=world_size,
        timeout_s=timeout_s,
        collective_timeout_s=timeout_s + 30,
        backend="gloo",
        rank_data=rank_data,
        isolation=isolation.choose("auto")[0],
        disable_userns=isolation.Isolation("none").disable_userns,
        extra_code=(str(ROOT / "tests"),),
    )


@pytest.mark.parametrize(
    "launcher, world_size",
    [(LocalLauncher(), 2), (LocalLauncher(), 4), (SubmititLauncher("local"), 2)],
    ids=["local-2", "local-4", "submitit-2"],
)
def test_every_rank_returns(launcher, world_size):
    results = launcher.run(job("sum_of_ranks", world_size))
    expected = world_size * (world_size + 1) / 2
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(torch.equal(r["sum"], torch.tensor([expected])) for r in results)


@pytest.mark.parametrize("launcher", [LocalLauncher(), SubmititLauncher("local")], ids=["local", "submitit"])
def test_hang_names_the_rank_that_never_arrived(launcher):
    started = time.monotonic()
    with pytest.raises(StudentTimedOut) as raised:
        launcher.run(job("rank_one_hangs", timeout_s=20))
    assert time.monotonic() - started < 40
    assert "rank(s) [0] waited in collective #2 (all_reduce)" in raised.value.message
    assert "rank(s) [1] never arrived (rank 1 stopped after #1)" in raised.value.message


def test_a_skipped_collective_is_explained():
    with pytest.raises(StudentError) as raised:
        LocalLauncher().run(job("rank_one_skips_a_collective", timeout_s=30))
    assert "rank(s) [0] waited in collective #2 (all_reduce); rank(s) [1] never arrived" in str(raised.value)


def test_an_error_on_one_rank_names_it():
    started = time.monotonic()
    with pytest.raises(StudentError, match="rank 1 of 2 raised ValueError: rank one is unhappy"):
        LocalLauncher().run(job("rank_one_raises"))
    assert time.monotonic() - started < 20


def test_a_dead_rank_is_a_crash():
    with pytest.raises(StudentCrashed, match="rank 1 of 2 died \\(exited with status 3\\)"):
        LocalLauncher().run(job("rank_one_dies"))


class CountingLauncher(LocalLauncher):
    def __init__(self):
        super().__init__()
        self.runs = 0

    def run(self, job: RankJob) -> list:
        self.runs += 1
        return super().run(job)


def test_a_group_that_does_not_form_is_launched_again_then_the_graders_error():
    """A process group that fails to form (here a backend torch does not know; on a loaded machine, gloo's connections
    timing out) fails before any student code: launched once more, and then reported whole as the grader's error,
    never as the student's."""
    launcher = CountingLauncher()
    try:
        with pytest.raises(GroupSetupFailed) as raised:
            launch(launcher, dataclasses.replace(job("sum_of_ranks"), backend="no-such-backend"))
    finally:
        launcher.close()
    assert launcher.runs == 2
    assert raised.value.status == "failed" and not isinstance(raised.value, StudentError)
    assert raised.value.message.startswith("grader error, not your code's: rank ")
    assert "could not join the process group" in raised.value.message and "no-such-backend" in raised.value.message
    assert launch(launcher, job("sum_of_ranks"))[1]["sum"].item() == 3 and launcher.runs == 3


def test_no_rank_outlives_its_run(monkeypatch):
    marker = uuid.uuid4().hex
    monkeypatch.setenv("GRADER_TEST_RUN", marker)
    with pytest.raises(StudentTimedOut):
        LocalLauncher().run(job("rank_one_hangs", timeout_s=5))
    time.sleep(0.5)
    assert processes_with(marker) == []


def test_each_rank_receives_only_its_own_data():
    secrets = [torch.randn(3) for _ in range(3)]
    results = LocalLauncher().run(job("own_data_and_what_peers_can_see", 3, rank_data=secrets))
    for rank, result in enumerate(results):
        assert torch.equal(result["own"], secrets[rank])
        assert result["descriptors_of_peers"] == [], result  # no other rank's descriptor is open anywhere it can look


def test_one_group_serves_launches_until_one_times_out():
    """A launch reuses the implementation's group (forks, not a new sandbox and interpreter); a hang ends the group
    with its ranks, and the next launch starts a fresh one."""
    launcher = LocalLauncher()
    try:
        launcher.run(job("sum_of_ranks"))
        (group,) = launcher.groups.values()
        assert launcher.run(job("sum_of_ranks", 4))[3]["sum"].item() == 10
        assert list(launcher.groups.values()) == [group] and group.alive()
        with pytest.raises(StudentTimedOut):
            launcher.run(job("rank_one_hangs", timeout_s=5))
        assert not group.alive() and not launcher.groups
        assert launcher.run(job("sum_of_ranks"))[1]["sum"].item() == 3
        assert list(launcher.groups.values()) != [group]
    finally:
        launcher.close()
    assert not launcher.groups


def test_what_a_launch_leaves_running_is_killed_before_the_next():
    marker = uuid.uuid4().hex
    launcher = LocalLauncher()
    try:
        assert launcher.run(dataclasses.replace(job("rank_zero_leaves_a_daemon"), args=(marker,))) == [0, 1]
        assert processes_with(marker) == [], "a detached process of a rank outlived its launch"
    finally:
        launcher.close()
