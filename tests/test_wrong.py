"""The grader fails each deliberately wrong implementation of tests/wrong/ (see tests/mutants.py) in its declared
test, with a message that names its fault.

Starting `pytest grader` costs seconds before its first test, so the mutants are graded in rounds rather than one
run each: a round's package holds one mutant of each of several problems, and its one run selects exactly the test
each of them must fail. That a mutant's verdict rests on its own problem's test alone is the grader's promise that
nothing one problem's code does changes another problem's results: every round relies on it, and so tests it. Each
round also checks that no process it started outlives it.

The first round of each set of grader arguments, which holds one mutant of every problem, is graded once more in
the students' copy (no reference there: its stored expectations, see grader/expectations), which must fail each of
its mutants in the same test with the same status and points. Once per problem suffices: the copy draws the same
inputs as the live grader and judges them by the expectations stored for that problem, whatever the code under
test; tests/test_release.py compares every test of a few problems. Replaying every round would double this
file's time, the largest share of the suite's.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import mutants
from tests.grading import GraderRun, processes_with, run_grader

MUTANTS = mutants.discover()
# A round's limit: the grader's start, then the slowest mutants' share (a failure is shrunk by replaying its test).
START_S, PER_MUTANT_S = 120, 120
# A round keeps one core busy for about two thirds of its time (its grader waits for workers that wait for it), so two
# rounds at once use both of CI's cores; the grader's time limits follow the reference's time in the same test, so
# they grow with the load.
CONCURRENT_ROUNDS = 2


@dataclass
class GradedRound:
    run: GraderRun
    survivors: list[int]  # processes of the run still alive after it
    replayed: GraderRun | None  # the same round graded in the students' copy, from stored expectations


REPLAYED = frozenset(mutant.id for mutant in mutants.firsts(MUTANTS))  # the mutants the students' copy grades too


def grade(members: list[mutants.Mutant], package: Path, students_copy: Path) -> GradedRound:
    mutants.materialise(members, package)
    marker = uuid.uuid4().hex
    tests = [mutant.node_id for mutant in members]
    timeout_s = START_S + PER_MUTANT_S * len(members)
    run = run_grader(package, *members[0].grader_args, tests=tests, env={"MUTANT_ROUND": marker}, timeout_s=timeout_s)
    survivors = processes_with(marker)
    replayed = None
    if any(mutant.id in REPLAYED for mutant in members):
        replayed = run_grader(package, *members[0].grader_args, tests=tests, timeout_s=timeout_s, cwd=students_copy)
    return GradedRound(run, survivors, replayed)


@pytest.fixture(scope="module")
def round_of(request, tmp_path_factory, students_copy):
    """The graded round of a mutant. Rounds are formed from the mutants this session selected (so `-k` one mutant
    grades that one alone) and graded CONCURRENT_ROUNDS at a time, in order, from the first mutant's request on."""
    selected = list({item.callspec.params["mutant"].id: item.callspec.params["mutant"]
                     for item in request.session.items if item.parent is request.node}.values())
    rounds = mutants.rounds(selected)
    packages = [tmp_path_factory.mktemp(f"round{number}_") for number in range(len(rounds))]
    with ThreadPoolExecutor(CONCURRENT_ROUNDS) as pool:
        graded = [pool.submit(grade, members, package, students_copy) for members, package in zip(rounds, packages)]

        def of(mutant: mutants.Mutant) -> GradedRound:
            return graded[next(number for number, members in enumerate(rounds) if mutant in members)].result()

        yield of
        for future in graded:
            future.cancel()


def case(mutant: mutants.Mutant):
    not_caught = pytest.mark.xfail(strict=True, raises=AssertionError, reason=mutant.xfail)
    return pytest.param(mutant, id=mutant.id, marks=[not_caught] if mutant.xfail else [])


# In the order of their rounds, so that the report follows the grader runs.
@pytest.mark.parametrize("mutant", [case(mutant) for members in mutants.rounds(MUTANTS) for mutant in members])
def test_grader_fails_mutant_for_its_fault(mutant, round_of):
    graded = round_of(mutant)
    check_fails_for_its_fault(graded.run, mutant)
    assert not graded.survivors, f"processes {graded.survivors} of {mutant.id}'s round outlived its grader run"


@pytest.mark.parametrize("mutant", [case(mutant) for members in mutants.rounds(MUTANTS) for mutant in members
                                    if mutant.id in REPLAYED])
def test_students_copy_fails_mutant_for_its_fault(mutant, round_of):
    """The same verdict from the expectations stored for the students' copy, with no reference there: the same
    test fails with the same status and points as in the live grader. The message may show another failing input:
    the copy reports the first one drawn, the live grader the one it shrank to."""
    graded = round_of(mutant)
    name = f"{mutant.problem} :: {mutant.test}"
    live, copy = (next((test for test in run.results["tests"] if test["name"] == name), None)
                  for run in (graded.run, graded.replayed))
    assert copy is not None, f"{name} did not run in the students' copy:\n{graded.replayed.output[-3000:]}"
    assert live is not None and live.get("status") == "failed", f"{name} did not fail live"
    assert copy.get("status") == "failed", f"{name} passed in the students' copy for {mutant.id}: {copy['output']}"
    assert copy["output"].startswith(mutant.status), f"{name}: expected status {mutant.status!r}: {copy['output']}"
    assert (copy["score"], copy["max_score"]) == (live["score"], live["max_score"]), (copy, live)


def check_fails_for_its_fault(run: GraderRun, mutant: mutants.Mutant) -> None:
    name = f"{mutant.problem} :: {mutant.test}"
    entry = next((test for test in run.results["tests"] if test["name"] == name), None)
    assert entry is not None, f"{name} did not run:\n{run.output[-3000:]}"
    message = entry["output"]
    assert entry.get("status") == "failed", f"{name} passed for {mutant.id} ({mutant.why}): {message}"
    assert message.startswith(mutant.status), f"{name}: expected status {mutant.status!r}, got: {message}"
    missing = [fragment for fragment in mutant.fragments if fragment.lower() not in message.lower()]
    assert not missing, f"{name} failed without naming {missing}:\n{message}"
    if mutant.any_of:
        assert any(word.lower() in message.lower() for word in mutant.any_of), f"none of {mutant.any_of} in:\n{message}"
