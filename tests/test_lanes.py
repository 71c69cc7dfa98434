"""`pytest grader --jobs N`: problems graded in concurrent lanes give the same table, failures and results file as
one process, and a lane's results reach the parent whole (grader.session.lanes)."""

from __future__ import annotations

import shutil

from assignment.registry import PROBLEMS
from grader.session import lanes
from tests import mutants
from tests.grading import ROOT, assert_fails_for, run_grader


def test_problems_are_dealt_longest_first_to_the_least_loaded_lane():
    work = {"a": 1.0, "b": 5.0, "c": 3.0, "d": 2.0}
    assert lanes.deal(work, 2) == [["b", "a"], ["c", "d"]]
    assert lanes.deal(work, 9) == [["b"], ["c"], ["d"], ["a"]]  # never an empty lane


def test_a_record_being_written_is_not_read_half(tmp_path):
    path = tmp_path / "lane.records"
    reader = lanes.RecordReader(path)
    assert reader.new_records() == []
    lanes.append_record(path, ("started", "moe.router"))
    whole = path.read_bytes()
    lanes.append_record(path, ("result", "x" * 100, None))
    path.write_bytes(path.read_bytes()[:-10])  # the second record's end is not written yet
    assert reader.new_records() == [("started", "moe.router")]
    path.write_bytes(whole)
    lanes.append_record(path, ("result", "x" * 100, None))
    assert reader.new_records() == [("result", "x" * 100, None)]


def test_lanes_grade_each_problem_as_one_process_would(tmp_path):
    """Three problems in two lanes: a wrong one fails its named test with its detail printed, a correct one keeps
    full marks, a missing one is "not implemented"; the table lists the three, the exit status says some failed."""
    package = tmp_path / "impl"
    mutant = mutants.load(mutants.WRONG / "moe" / "accounting" / "tied_counted_twice")
    mutants.materialise([mutant], package)
    (package / "parallel").mkdir(exist_ok=True)
    shutil.copy(ROOT / "reference" / "parallel" / "accounting.py", package / "parallel" / "accounting.py")
    run = run_grader(package, "--problem", "moe.accounting,parallel.accounting,moe.router", "--jobs", "2")
    assert_fails_for(run, "moe.accounting", mutant.test, *mutant.fragments)
    assert "tied_embeddings=True" in run.output.split("= score =")[0], "the failure's detail is printed"
    by_problem = {problem: [t.get("status") for t in run.tests_of(problem)]
                  for problem in ("moe.accounting", "parallel.accounting", "moe.router")}
    assert set(by_problem["parallel.accounting"]) == {"passed"}, run.output[-3000:]
    assert set(by_problem["moe.router"]) == {"failed"}
    assert all(t["output"].startswith("not implemented") for t in run.tests_of("moe.router"))
    table = run.output.split("= score =")[1]
    assert {"moe.accounting", "parallel.accounting", "moe.router"} <= set(table.split())
    assert "kernels.softmax" not in table


def test_problem_times_are_kept_per_profile_and_device(tmp_path, monkeypatch):
    monkeypatch.setattr(lanes, "TIMES_FILE", tmp_path / "cache" / "seconds.json")
    monkeypatch.setattr(lanes, "SHIPPED_TIMES_FILE", tmp_path / "shipped.json")
    assert lanes.known_seconds("public/cuda") == {}
    lanes.remember_seconds("public/cuda", {"moe.router": 70.24, "kernels.matmul": 115.8})
    lanes.remember_seconds("public/cuda", {"moe.router": 60.0})
    lanes.remember_seconds("ci/cpu", {"moe.router": 9.0})
    assert lanes.known_seconds("public/cuda") == {"moe.router": 60.0, "kernels.matmul": 115.8}
    assert lanes.known_seconds("ci/cpu") == {"moe.router": 9.0}
    lanes.TIMES_FILE.write_text("not json")
    assert lanes.known_seconds("ci/cpu") == {}  # a damaged file deals by tests again


def test_a_first_run_is_dealt_by_the_times_recorded_with_the_project(tmp_path, monkeypatch):
    monkeypatch.setattr(lanes, "TIMES_FILE", tmp_path / "cache" / "seconds.json")
    shipped = lanes.known_seconds("public/cuda")
    assert {problem.id for problem in PROBLEMS} <= set(shipped)
    lanes.remember_seconds("public/cuda", {"moe.router": 1.5})
    assert lanes.known_seconds("public/cuda") == {**shipped, "moe.router": 1.5}  # this machine's own times win
