"""`python -m grader submit` and `grade-all` against a real single-node Slurm cluster (started by .ci/slurm/up when
these tests find none and run as root), and once through submitit's local executor."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from assignment.registry import PROBLEMS
from grader.__main__ import problem_selection
from grader.cluster import site
from grader.cluster.grade_all import Submission, selected_problems, summary, write_class_csv
from grader.cluster.jobs import ClusterOptions, make_executor
from tests.grading import ROOT, run_grader

HOSTILE = Path(__file__).resolve().parent / "hostile"
FAST = ("--profile", "ci", "--problems", "kernels.softmax,moe.router")
# One softmax test and one router test: a hanging softmax then costs one call limit (15 s at this scale), and correct
# code keeps a comfortable margin on a loaded two-core machine.
HOSTILE_RUN = (*FAST, "--select", "matches_reference_fp32 or indices_and_gates", "--timeout-scale", "0.25")


def cluster_is_up() -> bool:
    if shutil.which("scontrol") is None:
        return False
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    return ping.returncode == 0 and "UP" in ping.stdout


@pytest.fixture(scope="module")
def slurm():
    started = False
    if not cluster_is_up():
        if os.geteuid() != 0:
            pytest.skip("needs a Slurm cluster: as root, .ci/slurm/up starts a single-node one")
        subprocess.run([str(ROOT / ".ci" / "slurm" / "up")], check=True, timeout=900)
        started = True
    yield
    if started:
        subprocess.run([str(ROOT / ".ci" / "slurm" / "down")], timeout=300)


def grader_cli(*args: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grader", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)


def submission(tmp_path: Path, name: str, base: str, softmax: str | None = None, router_from: str | None = None):
    """A submission folder: a copy of `base` (reference or student_impl) with optional replacements."""
    path = tmp_path / "submissions" / name
    shutil.copytree(ROOT / base, path, ignore=shutil.ignore_patterns("__pycache__"))
    if softmax:
        shutil.copy(HOSTILE / softmax / "kernels" / "softmax.py", path / "kernels" / "softmax.py")
    if router_from:
        shutil.copy(ROOT / router_from / "moe" / "router.py", path / "moe" / "router.py")
    return path


def job_id(output: str) -> str:
    return re.search(r"as job (\d+)", output).group(1)


def test_submission_scores_as_a_local_run(slurm, tmp_path):
    impl = submission(tmp_path, "alice", "reference")
    shutil.copy(ROOT / "student_impl" / "moe" / "router.py", impl / "moe" / "router.py")
    done = grader_cli("submit", "--impl", str(impl), "--executor", "slurm", "--work-dir", str(tmp_path / "work"),
                      "--results-json", str(tmp_path / "results.json"), *FAST)
    assert done.returncode == 1, done.stdout + done.stderr  # graded, with the router not implemented
    assert "kernels.softmax  passed" in done.stdout and "moe.router       not implemented" in done.stdout
    local = run_grader(impl, "--problem", "kernels.softmax,moe.router")
    on_cluster = json.loads((tmp_path / "results.json").read_text())
    assert on_cluster["score"] == local.results["score"] > 0


def test_the_students_copy_submits_to_the_reference_the_site_names(slurm, students_copy, tmp_path):
    """The students' copy holds no reference: its submissions are graded by the grader, reference and profile that
    the cluster's site file names (here this repository, which the copy never sees), and by nothing without one."""
    copy = students_copy
    site_file = tmp_path / "site.toml"
    site_file.write_text(f'grader = "{ROOT}"\nprofile = "ci"\n')

    def submit(impl: Path, site_path: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "grader", "submit", "--impl", str(impl), "--executor", "slurm", "--work-dir",
             str(tmp_path / "work"), "--results-json", str(tmp_path / "results.json"), "--problems", "kernels.softmax",
             "--select", "matches_reference_fp32 or long_rows"],
            cwd=copy, capture_output=True, text=True, timeout=900,
            env={**os.environ, site.SITE_FILE_VARIABLE: str(site_path)})

    stubs = submit(copy / "student_impl", site_file)
    assert stubs.returncode == 1 and "kernels.softmax  not implemented  0/" in stubs.stdout, stubs.stdout + stubs.stderr
    solved = submit(shutil.copytree(ROOT / "reference", tmp_path / "solved"), site_file)
    assert solved.returncode == 0 and "kernels.softmax  passed" in solved.stdout, solved.stdout + solved.stderr
    assert json.loads((tmp_path / "results.json").read_text())["extra_data"]["profile"] == "ci"
    unconfigured = submit(copy / "student_impl", tmp_path / "absent.toml")
    assert unconfigured.returncode == 2 and "no grading site file" in unconfigured.stdout + unconfigured.stderr


def test_two_rank_problem_runs_as_a_slurm_job_step(slurm, tmp_path):
    """Each launch of ranks is a job step whose one task starts both ranks in one sandbox."""
    impl = submission(tmp_path, "bob", "reference")
    done = grader_cli("submit", "--impl", str(impl), "--executor", "slurm", "--work-dir", str(tmp_path / "work"),
                      "--results-json", str(tmp_path / "results.json"), "--profile", "ci",
                      "--problems", "parallel.ddp", "--select", "broadcast")
    assert done.returncode == 0, done.stdout + done.stderr
    steps = subprocess.run(["sacct", "-j", job_id(done.stdout), "-n", "-P", "--format=JobName,NTasks"],
                           capture_output=True, text=True).stdout.splitlines()
    rank_steps = [line for line in steps if line.startswith("ranks-parallel.ddp|")]
    assert rank_steps and all(line.split("|")[1] == "1" for line in rank_steps), steps
    assert "isolation: bwrap" in done.stdout


def test_hanging_test_times_out_and_the_rest_is_graded(slurm, tmp_path):
    impl = submission(tmp_path, "carol", "reference", softmax="hang")
    done = grader_cli("submit", "--impl", str(impl), "--executor", "slurm", "--work-dir", str(tmp_path / "work"),
                      "--results-json", str(tmp_path / "results.json"), *HOSTILE_RUN)
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"kernels\.softmax\s+timed out", done.stdout)
    assert re.search(r"moe\.router\s+passed\s+5/5", done.stdout)


def test_grade_all_builds_the_class_table(slurm, tmp_path):
    submissions = tmp_path / "submissions"
    submission(tmp_path, "complete", "reference")
    submission(tmp_path, "partial", "student_impl", router_from="reference")
    submission(tmp_path, "empty", "student_impl")
    submission(tmp_path, "crashing", "reference", softmax="segfault")
    submission(tmp_path, "hanging", "reference", softmax="hang")
    out = tmp_path / "out"
    args = ("grade-all", str(submissions), "--out", str(out), "--executor", "slurm", "--parallel", "2", *HOSTILE_RUN)
    done = grader_cli(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    table = csv.DictReader(open(out / "class.csv"))
    assert table.fieldnames == ["student", "kernels.softmax", "moe.router", "total", "status"]
    rows = {row["student"]: row for row in table}
    expected = {  # (softmax, router, total) for the selected tests: softmax's fp32 test and the router's indices and
        # gates (5 points each)
        "complete": ("5", "5", "10"), "partial": ("0", "5", "5"), "empty": ("0", "0", "0"),
        "crashing": ("0", "5", "5"), "hanging": ("0", "5", "5"),
    }
    for student, (softmax, router, total) in expected.items():
        row = rows[student]
        assert (row["kernels.softmax"], row["moe.router"], row["total"], row["status"]) == \
            (softmax, router, total, "graded"), row
    assert "5 submissions: 5 graded" in (out / "summary.txt").read_text()

    again = grader_cli(*args)
    assert "5 submissions, 5 already graded and unchanged" in again.stdout
    (submissions / "partial" / "kernels" / "softmax.py").write_text(
        (ROOT / "reference" / "kernels" / "softmax.py").read_text())
    changed = grader_cli(*args)
    assert "5 submissions, 4 already graded and unchanged" in changed.stdout
    rows = {row["student"]: row for row in csv.DictReader(open(out / "class.csv"))}
    assert rows["partial"]["total"] == "10"


def test_cancelled_job_is_not_graded_quickly(slurm, tmp_path):
    impl = submission(tmp_path, "dave", "reference", softmax="hang")
    process = subprocess.Popen(
        [sys.executable, "-m", "grader", "submit", "--impl", str(impl), "--executor", "slurm",
         "--work-dir", str(tmp_path / "work"), "--results-json", str(tmp_path / "results.json"), *FAST],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = ""
    for line in process.stdout:
        output += line
        if re.search(r"job \d+: RUNNING", line):
            break
    subprocess.run(["scancel", job_id(output)], check=True)
    cancelled_at = time.monotonic()
    rest, _ = process.communicate(timeout=120)
    output += rest
    assert process.returncode == 2, output
    assert "not graded: the grading job was cancelled" in output
    assert time.monotonic() - cancelled_at < 60
    assert not (tmp_path / "results.json").exists()


def test_every_submission_gets_a_fresh_job_folder(tmp_path):
    options = ClusterOptions(executor="local")
    make_executor(options, tmp_path / "jobs")
    with pytest.raises(FileExistsError):
        make_executor(options, tmp_path / "jobs")


def test_submit_runs_locally_without_slurm(tmp_path):
    impl = submission(tmp_path, "erin", "reference")
    done = grader_cli("submit", "--impl", str(impl), "--executor", "local", "--work-dir", str(tmp_path / "work"),
                      "--results-json", str(tmp_path / "results.json"), "--profile", "ci",
                      "--problems", "moe.router")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"moe\.router\s+passed\s+20/20", done.stdout)
    runs = list((tmp_path / "work").iterdir())
    assert len(runs) == 1 and (runs[0] / "erin" / "moe" / "router.py").exists()


def test_class_table_has_a_column_for_each_selected_problem_only(tmp_path):
    """Written from results already on disk, as grade-all does after its jobs: no Slurm needed."""
    graded = Submission("frank", tmp_path / "submissions" / "frank", tmp_path / "out" / "frank")
    graded.out.mkdir(parents=True)
    graded.results.write_text(json.dumps({"score": 9.0, "tests": [
        {"name": "moe.router :: test_tie_breaking", "score": 4.0},
        {"name": "kernels.softmax :: test_matches_reference_fp32", "score": 5.0},
        {"name": "kernels.softmax :: test_long_rows", "score": 0.0},
    ]}))
    lost = Submission("grace", tmp_path / "submissions" / "grace", tmp_path / "out" / "grace")
    lost.out.mkdir(parents=True)
    lost.not_graded.write_text("the grading job was cancelled\n")
    problems = selected_problems(["moe.router", "kernels.softmax"])

    rows = write_class_csv([graded, lost], tmp_path / "out", problems)

    table = csv.DictReader(open(tmp_path / "out" / "class.csv"))
    assert table.fieldnames == ["student", "kernels.softmax", "moe.router", "total", "status"]  # registry order
    assert list(table) == rows == [
        {"student": "frank", "kernels.softmax": "5", "moe.router": "4", "total": "9", "status": "graded"},
        {"student": "grace", "kernels.softmax": "", "moe.router": "", "total": "",
         "status": "not graded: the grading job was cancelled"},
    ]
    text = summary(rows, problems)
    softmax, router = problems
    assert f"kernels.softmax: mean 5.00 of {softmax.max_points:g}" in text
    assert f"moe.router: mean 4.00 of {router.max_points:g}" in text
    assert "parallel.ddp" not in text
    assert len(selected_problems(None)) == len(PROBLEMS)


def test_problems_select_exactly_their_own_tests():
    """-k matches substrings: `--problems parallel.ddp` must not grade `parallel.ddp_bucketed` too."""
    problem_ids, pytest_args = problem_selection("parallel.ddp,moe.router", None)
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "grader", "--collect-only", "-q", "-p", "no:cacheprovider", *pytest_args],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    files = {line.split("::")[0] for line in collected.stdout.splitlines() if "::" in line}
    assert files == {"grader/parallel/test_ddp.py", "grader/moe/test_router.py"}, collected.stdout + collected.stderr
    assert problem_ids == ["parallel.ddp", "moe.router"]


def test_an_unknown_problem_is_refused_before_anything_is_graded(tmp_path):
    done = grader_cli("grade-all", str(tmp_path), "--out", str(tmp_path / "out"), "--problems", "kernels.sofmax")
    assert done.returncode == 2 and "unknown problem kernels.sofmax" in done.stderr, done.stdout + done.stderr
    assert not (tmp_path / "out").exists()
