"""`pytest grader --jobs N`: the selected problems graded in N concurrent pytest processes ("lanes").

One grading process keeps one GPU busy only part of the time: its workers start, compile and wait for the grader's
own reference work. On a many-core GPU host, N lanes of whole problems run side by side and the wall time falls
towards that of the slowest lane. Problems are dealt to lanes longest first, each to the lane with the least work so
far. Work is each problem's time in the last run in lanes on this machine with the same profile and device (kept in
TIMES_FILE; before the first run on a GPU host, the times recorded with the project), or, while some selected problem
has none, its tests times the profile's examples per test.

The grading process that was started (the parent) collects the tests, then runs no test itself. Each lane is a child
`pytest` over the node ids of its problems, with the parent's grader options; it has its own sandboxes, workers and
rank groups, exactly as a run of those problems alone. As each of its tests ends, the child appends the test's
result to its record file (`--lane-record`); the parent reads the records while the lanes run, shows the progress
line of each problem, and prints one failure summary and one score table for all of them. The record files are in a
private folder of the parent's; student code never writes them, since it runs only in the lanes' sandboxes. A lane
that dies without recording some of its tests leaves those tests as "grader error", with the end of its output: other
lanes are not affected.

The students' copy, which grades on the CPU, runs its speed tests in one more lane after the others, with the GPUs
visible (grader.expectations.students_copy).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from assignment.registry import Problem
from grader.session.items import problem_of
from grader.session.scoring import TestResult

POLL_S = 0.5
LOG_TAIL_CHARACTERS = 2000
TIMES_FILE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpu-systems-grader" / "seconds.json"
SHIPPED_TIMES_FILE = Path(__file__).with_name("lane_seconds.json")
# Grader options a lane takes from the parent (their values as parsed, not as typed).
PASSED_OPTIONS = ("--reference", "--profile", "--launcher", "--timeout-scale", "--world-sizes", "--isolation",
                  "--expectations", "--record-expectations", "--source-policy", "--dump-failing")


def deal(work_by_problem: dict[str, float], lanes: int) -> list[list[str]]:
    """Problem ids per lane: longest first, each to the lane with the least work so far (the lowest on a tie)."""
    dealt: list[list[str]] = [[] for _ in range(min(lanes, len(work_by_problem)))]
    load = [0.0] * len(dealt)
    for problem_id in sorted(work_by_problem, key=lambda p: -work_by_problem[p]):
        lane = min(range(len(dealt)), key=lambda index: (load[index], index))
        dealt[lane].append(problem_id)
        load[lane] += work_by_problem[problem_id]
    return dealt


def known_seconds(key: str) -> dict[str, float]:
    """Each problem's seconds in the last run in lanes under `key` (profile and device type) on this machine, over
    those recorded with the project (SHIPPED_TIMES_FILE: the reference on one H200, 16 cores, in six lanes), so that
    a first run on a GPU host is dealt by time too; {} if neither knows the key."""
    known = {}
    for path in (SHIPPED_TIMES_FILE, TIMES_FILE):
        try:
            known.update(json.loads(path.read_text()).get(key, {}))
        except (OSError, ValueError, AttributeError):
            pass
    return known


def remember_seconds(key: str, seconds: dict[str, float]) -> None:
    """Keep these problems' seconds for the next run's dealing; a machine where nothing can be kept deals by tests."""
    try:
        kept = json.loads(TIMES_FILE.read_text()) if TIMES_FILE.exists() else {}
        kept.setdefault(key, {}).update({problem_id: round(s, 1) for problem_id, s in seconds.items()})
        TIMES_FILE.parent.mkdir(parents=True, exist_ok=True)
        partial = TIMES_FILE.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(kept, indent=1, sort_keys=True))
        partial.replace(TIMES_FILE)
    except (OSError, ValueError, AttributeError):
        pass


def append_record(path: Path, record: tuple) -> None:
    """In a lane: add one record (pickled, length-prefixed, so that the parent never reads half of one)."""
    data = pickle.dumps(record)
    with path.open("ab") as file:
        file.write(len(data).to_bytes(8, "little") + data)
        file.flush()


class RecordReader:
    """In the parent: the records a lane has appended since the last read."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def new_records(self) -> list[tuple]:
        try:
            data = self.path.read_bytes()[self.offset:]
        except FileNotFoundError:
            return []
        records = []
        while len(data) >= 8:
            size = int.from_bytes(data[:8], "little")
            if len(data) < 8 + size:
                break  # the rest is still being written
            records.append(pickle.loads(data[8:8 + size]))
            data = data[8 + size:]
            self.offset += 8 + size
        return records


class Lane:
    def __init__(self, index: int, nodeids: list[str], folder: Path):
        self.nodeids = nodeids  # those without a result yet
        self.record = folder / f"lane{index}.records"
        self.log = folder / f"lane{index}.log"
        self.reader = RecordReader(self.record)
        self.process: subprocess.Popen | None = None

    def start(self, config: pytest.Config, impl: Path, environment: dict[str, str]) -> None:
        arguments = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--impl", str(impl),
                     "--lane-record", str(self.record), "--rootdir", str(config.rootpath)]
        for option in PASSED_OPTIONS:
            value = config.getoption(option)
            if value is not None:
                arguments += [option, str(value)]
        for flag in ("--refuse-unisolated", "--allow-unisolated"):
            if config.getoption(flag):
                arguments.append(flag)
        with self.log.open("wb") as log:
            self.process = subprocess.Popen([*arguments, *self.nodeids], stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, cwd=config.invocation_params.dir,
                                            env=environment)

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-LOG_TAIL_CHARACTERS:]
        except FileNotFoundError:
            return ""


def lane_environment(profile: str, secret_seed: int | None) -> dict[str, str]:
    """The lanes' environment: the parent's (its secrets already removed), the grading profile's seed given back
    to them alone (a lane removes it again before any student code starts)."""
    environment = dict(os.environ)
    if profile == "grading" and secret_seed is not None:
        environment["GRADER_SECRET_SEED"] = str(secret_seed)
    return environment


def deal_items(session: pytest.Session, lanes: int, seconds: dict[str, float]) -> list[list[str]]:
    """The node ids of session.items per lane: whole problems, dealt by `seconds` where it knows every problem, else
    by the profile's examples per test."""
    nodeids_by_problem: dict[str, list[str]] = {}
    work: dict[str, float] = {}
    for item in session.items:
        problem: Problem = problem_of(item)
        nodeids_by_problem.setdefault(problem.id, []).append(item.nodeid)
        work[problem.id] = work.get(problem.id, 0.0) + problem.budgets[session.config.getoption("--profile")]
    if set(work) <= set(seconds):
        work = {problem_id: seconds[problem_id] for problem_id in work}
    return [[n for p in problem_ids for n in nodeids_by_problem[p]] for problem_ids in deal(work, lanes)]


def run_lanes(config: pytest.Config, nodeids_by_lane: list[list[str]], impl: Path, environment: dict[str, str],
              on_record) -> dict[str, list]:
    """Run one lane per list of node ids, side by side, in `environment`; `on_record(record)` sees every record as
    it arrives. Returns the node ids each lane left without a result, with the end of its output:
    {log tail: [node ids]}."""
    folder = Path(tempfile.mkdtemp(prefix="grader-lanes-"))  # mode 0700: the parent's alone
    running = [Lane(index, nodeids, folder) for index, nodeids in enumerate(nodeids_by_lane)]
    unrecorded: dict[str, list] = {}
    try:
        for lane in running:
            lane.start(config, impl, environment)
        while running:
            time.sleep(POLL_S)
            for lane in list(running):
                ended = lane.process.poll() is not None
                for record in lane.reader.new_records():
                    on_record(record)
                    if record[0] == "result":
                        lane.nodeids.remove(record[1].nodeid)
                if ended:
                    running.remove(lane)
                    if lane.nodeids:
                        unrecorded[lane.log_tail()] = lane.nodeids
    finally:
        for lane in running:
            lane.process.kill()
            lane.process.wait()
        shutil.rmtree(folder, ignore_errors=True)
    return unrecorded


def lost_result(nodeid: str, problem: Problem, group: str, log_tail: str) -> TestResult:
    """A test its lane ended without grading; its share is set where its group's size is known (the parent)."""
    return TestResult(nodeid, problem, group, 0.0, status="grader error",
                      message=f"its lane of grading ended before this test had a result; the lane's output ended "
                              f"with:\n{log_tail}")
