"""The sandbox is nobody outside it: its processes never run as root, each sandbox's process and memory limits are its
own, it mounts nothing of the machine a student could use against the grade, a Python anywhere runs in it, and a
grading that cannot sandbox says so (or, for grades of record, refuses).

The side-by-side tests start sandboxes through grader.sandbox.isolation directly (two at once, each with a small
limit), as a root grader and, through setpriv, as an ordinary user's grader."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from grader.sandbox import cgroup, isolation, uids
from tests.grading import ATTACKED_AND_BYSTANDER, ROOT, assert_fails_for, run_grader
from tests.test_gradescope import run_autograder

HOSTILE = Path(__file__).resolve().parent / "hostile"
UNPRIVILEGED_UID = 54321  # an ordinary user's grader: no account needed
SYSTEM_PYTHON = Path("/usr/bin/python3")  # reachable by that user, unlike a Python under /root
LIMIT = 64  # processes and threads per sandbox in these tests

# Run by the grader's Python (root) or the system's (an ordinary user), with the repository's grader/ on sys.path:
# two sandboxes side by side, the first holding all the threads it can, the second starting its own while the first
# holds them; and who a sandboxed process is, seen from outside (bwrap's own processes aside: it runs no student code).
SIDE_BY_SIDE = r"""
import json, subprocess, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from grader.sandbox import cgroup, isolation, uids
if sys.argv[3] == "no cgroup":
    cgroup.parents = lambda: None
limit, marker = int(sys.argv[2]), sys.argv[4]
folder = Path(tempfile.mkdtemp(prefix="side-by-side-"))
folder.chmod(0o755)
(folder / "threads.py").write_text('''
import sys, threading, time
started, stop = 0, threading.Event()
try:
    for _ in range(int(sys.argv[1])):
        threading.Thread(target=stop.wait, daemon=True).start()
        started += 1
except RuntimeError:
    pass
print(started, flush=True)
time.sleep(float(sys.argv[2]))
''')
(folder / "threads.py").chmod(0o644)
mounts = isolation.Mounts(impl_dir=folder)
script = str(isolation.IMPL_ROOT / folder.name / "threads.py")
first = isolation.Isolation("bwrap", max_processes=limit)
second = first.fresh()
holding = first.popen([sys.executable, script, str(4 * limit), "4"], mounts, stdout=subprocess.PIPE, text=True,
                      env={"SIDE_BY_SIDE": marker})
held = int(holding.stdout.readline())
outside = []
for status in Path("/proc").glob("[0-9]*/status"):
    proc = status.parent
    try:
        if marker.encode() in (proc / "environ").read_bytes() and "bwrap" not in (proc / "comm").read_text():
            outside.append(int(next(l.split()[1] for l in status.read_text().splitlines() if l.startswith("Uid:"))))
    except OSError:
        pass
beside = second.popen([sys.executable, script, str(limit - 16), "0"], mounts, stdout=subprocess.PIPE, text=True)
started_beside = int(beside.communicate(timeout=60)[0])
holding.kill()
holding.wait()
for sandbox in (first, second):
    sandbox.close()
print(json.dumps({"held": held, "started_beside": started_beside, "outside_uids": outside}))
"""


def side_by_side(as_user: int | None, limits: str) -> dict:
    """Two sandboxes at once, started by a root grader (as_user None) or by an ordinary user's."""
    marker = uuid.uuid4().hex
    if as_user is None:
        command = [sys.executable, "-c", SIDE_BY_SIDE, str(ROOT), str(LIMIT), limits, marker]
    else:
        # The user must reach the grader's code: a copy in a folder anyone can read, as an installed grader would be.
        code = Path(tempfile.mkdtemp(prefix="grader-for-a-user-"))
        code.chmod(0o755)
        for package in ("grader", "assignment"):
            shutil.copytree(ROOT / package, code / package, ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run(["chmod", "-R", "a+rX", str(code)], check=True)
        command = ["setpriv", "--reuid", str(as_user), "--regid", str(as_user), "--clear-groups",
                   str(SYSTEM_PYTHON), "-c", SIDE_BY_SIDE, str(code), str(LIMIT), limits, marker]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd="/")
    finally:
        if as_user is not None:
            shutil.rmtree(code)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def root_grader_limits() -> list:
    kinds = [pytest.param("no cgroup", id="uid-per-sandbox")]
    if cgroup.parents() is not None:
        kinds.append(pytest.param("cgroup", id="cgroup"))
    return kinds


@pytest.mark.skipif(os.geteuid() != 0, reason="a root grader's sandboxes: the tests run as root in CI")
@pytest.mark.parametrize("limits", root_grader_limits())
def test_root_graders_sandboxes_are_not_root_and_limit_apart(limits):
    seen = side_by_side(None, limits)
    assert seen["outside_uids"] and 0 not in seen["outside_uids"], seen
    assert all(uid >= uids.FIRST_UID for uid in seen["outside_uids"]), seen
    assert LIMIT - 8 <= seen["held"] < LIMIT, seen  # the first sandbox stops at its own limit ...
    assert seen["started_beside"] == LIMIT - 16, seen  # ... and the second still has all of its own


@pytest.mark.skipif(os.geteuid() != 0 or not SYSTEM_PYTHON.exists(),
                    reason="becoming an ordinary user needs root, and that user a Python it can run")
def test_an_ordinary_users_sandboxes_limit_apart():
    seen = side_by_side(UNPRIVILEGED_UID, "no cgroup")
    assert seen["outside_uids"] == [UNPRIVILEGED_UID], seen  # mapped to the grader's own uid, never root
    assert LIMIT - 8 <= seen["held"] < LIMIT, seen
    assert seen["started_beside"] == LIMIT - 16, seen


@pytest.mark.skipif(cgroup.parents() is None, reason="this machine offers the grader no control group")
def test_a_sandbox_that_takes_too_much_memory_is_killed_alone(tmp_path):
    folder = Path(tempfile.mkdtemp(prefix="memory-"))
    folder.chmod(0o755)
    mounts = isolation.Mounts(impl_dir=folder)
    greedy = isolation.Isolation("bwrap", max_memory_bytes=256 << 20)
    modest = greedy.fresh()
    take = "import sys; block = b'x' * (int(sys.argv[1]) << 20); print('ok')"  # written, so resident
    try:
        killed = greedy.popen([sys.executable, "-c", take, "512"], mounts, stdout=subprocess.PIPE, text=True)
        kept = modest.popen([sys.executable, "-c", take, "128"], mounts, stdout=subprocess.PIPE, text=True)
        assert killed.communicate(timeout=60)[0] == "" and killed.returncode != 0
        assert kept.communicate(timeout=60)[0] == "ok\n" and kept.returncode == 0
    finally:
        greedy.close()
        modest.close()
        shutil.rmtree(folder)


def grader_refusal(*args: str, env: dict | None = None) -> str:
    """What `pytest grader` says when it stops at start (exit status 4, a usage error)."""
    command = [sys.executable, "-m", "pytest", "grader", "-q", "-p", "no:cacheprovider", "-k", "nothing", *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 4, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def test_refuses_a_sandbox_that_would_show_the_site_file():
    said = grader_refusal(env={"GRADER_SITE_FILE": "/etc/hosts"})  # /etc/hosts is mounted: name resolution reads it
    assert "student code could read the site file (/etc/hosts)" in said


def test_refuses_a_sandbox_that_would_show_the_reference():
    said = grader_refusal("--reference", str(ROOT / "assignment"))  # the grader's own code is mounted
    assert f"student code could read the reference ({ROOT / 'assignment'})" in said


def test_grades_of_record_refuse_to_run_unsandboxed():
    said = grader_refusal("--profile", "grading", "--isolation", "none", env={"GRADER_SECRET_SEED": "7"})
    assert "refusing to grade without a sandbox" in said and "--allow-unisolated" in said


def test_an_unsandboxed_grading_says_so_first(tmp_path):
    run = run_grader(ROOT / "reference", "--problem", "moe.router", "-k", "indices_and_gates", "--isolation", "none")
    assert run.output.lstrip().startswith("WARNING: isolation: none"), run.output[:500]
    assert run.results["output"].startswith("WARNING: isolation: none (student code runs as the grader's user")
    assert run.results["extra_data"]["isolation"] == "none"


def test_a_python_under_tmp_runs_in_the_sandbox(tmp_path):
    """A virtual environment under /tmp was hidden by the sandbox's own /tmp, and auto fell back to no sandbox."""
    venv = Path(tempfile.mkdtemp(prefix="venv-under-tmp-"))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
        done = subprocess.run([str(venv / "bin" / "python"), "-c",
                               "from grader.sandbox import isolation; print(isolation.choose('auto'))"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(venv)
    assert done.stdout.strip() == "('bwrap', '')", done.stdout + done.stderr


@pytest.fixture
def cluster_layout(tmp_path):
    """The layout the README suggests, where this user can write it: the site file in /etc, the reference in /opt."""
    tag = uuid.uuid4().hex[:8]
    writable = os.access("/etc", os.W_OK) and os.access("/opt", os.W_OK)
    etc, opt = (Path("/etc"), Path("/opt")) if writable else (tmp_path / "etc", tmp_path / "opt")
    site, course = etc / f"gpu-systems-grader-{tag}" / "site.toml", opt / f"course-{tag}"
    shutil.copytree(ROOT / "reference", course / "reference", ignore=shutil.ignore_patterns("__pycache__"))
    site.parent.mkdir(parents=True)
    site.write_text(f'grader = "{ROOT}"\nreference = "{course / "reference"}"\nprofile = "ci"\n')
    yield site, course / "reference"
    shutil.rmtree(site.parent)
    shutil.rmtree(course)


def reads_the_machine(folder: Path) -> Path:
    """A copy of the reference whose softmax looks for the reference, root's files and /opt from inside."""
    shutil.copytree(ROOT / "reference", folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(HOSTILE / "reads_the_machine" / "kernels" / "softmax.py", folder / "kernels" / "softmax.py")
    return folder


def assert_found_nothing(output: str) -> None:
    for fragment in ("reference: [Errno 2] No such file", "shadow: [Errno 2] No such file",
                     "opt: [Errno 2] No such file"):
        assert fragment in output, output
    assert int(re.search(r"uid outside (\d+)", output).group(1)) != 0, output


def test_the_cluster_layout_is_out_of_reach(tmp_path, cluster_layout):
    site, reference = cluster_layout
    run = run_grader(reads_the_machine(tmp_path / "impl"), *ATTACKED_AND_BYSTANDER, "--reference", str(reference),
                     "--source-policy", "off", env={"GRADER_SITE_FILE": str(site), "HOSTILE_SITE_GUESS": str(site)})
    assert_fails_for(run, "kernels.softmax", "matches_reference_fp32")
    assert_found_nothing(run.failures("kernels.softmax")[0]["output"])
    router = run.tests_of("moe.router")
    assert router and all(t["status"] == "passed" for t in router), run.output[-3000:]


def test_grade_all_grades_the_class_around_a_student_who_reads_the_machine(tmp_path, cluster_layout):
    site, reference = cluster_layout
    submissions, out = tmp_path / "submissions", tmp_path / "out"
    shutil.copytree(ROOT / "reference", submissions / "alice", ignore=shutil.ignore_patterns("__pycache__"))
    reads_the_machine(submissions / "mallory")
    done = subprocess.run(
        [sys.executable, "-m", "grader", "grade-all", str(submissions), "--out", str(out), "--executor", "local",
         "--reference", str(reference), "--profile", "ci", "--problems", "kernels.softmax",
         "--select", "matches_reference_fp32"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "HOSTILE_SITE_GUESS": str(site), "GRADER_SOURCE_POLICY": "off"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {row["student"]: row for row in csv.DictReader(open(out / "class.csv"))}
    assert rows["alice"]["kernels.softmax"] != "0" and rows["mallory"]["kernels.softmax"] == "0", rows
    mallory = json.loads((out / "mallory" / "results.json").read_text())
    assert_found_nothing(next(t["output"] for t in mallory["tests"] if t["status"] == "failed"))


def test_gradescope_upload_that_reads_the_machine_finds_nothing(tmp_path):
    zip_path = tmp_path / "autograder.zip"
    subprocess.run([sys.executable, "-m", "grader", "gradescope", str(zip_path), "--profile", "ci", "--problems",
                    "kernels.softmax"], cwd=ROOT, check=True, capture_output=True, text=True)
    root = tmp_path / "autograder"
    os.environ["HOSTILE_REFERENCE_GUESS"] = str(root / "source" / "reference")  # where the zip unpacks it
    os.environ["GRADER_SOURCE_POLICY"] = "off"
    try:
        results = run_autograder(zip_path, root, lambda upload: reads_the_machine(upload / "student_impl"))
    finally:
        del os.environ["HOSTILE_REFERENCE_GUESS"], os.environ["GRADER_SOURCE_POLICY"]
    assert results["tests"] and results["score"] == 0, results.get("output")
    assert_found_nothing("\n".join(test["output"] for test in results["tests"]))
