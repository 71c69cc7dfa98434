"""How long grading takes: each problem's grader run on its own, and one `pytest grader` over all of them, per
implementation and profile, on this machine.

    python benchmarks/grading_time.py [--impl reference] [--profiles ci,public,grading]
        [--problems kernels.softmax,moe.router] [--modes problems,whole] [--timeout-scale 1] [--jobs 1] [--lanes 1]
        [--compare]

Every run is `python -m pytest ... --results-json` in a subprocess, timed from start to exit; scores and test counts
come from its results file. The grading profile runs with a fixed benchmark seed. Records go to
benchmarks/results/grading_time.json, keyed by machine, implementation and profile (a record replaced by a new run
is kept as the new one's "before", which --compare prints next to it; a run over some problems replaces their rows and
keeps the others', each row naming the revision it was measured at), and every record is rendered into
benchmarks/results/grading_time.md.

On a GPU host, where one run over every problem takes minutes, `--modes whole --lanes 6` grades the problems in six
concurrent lanes (what `pytest grader --jobs 6` does) and records each problem's span within that run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

from assignment.registry import BY_ID, PROBLEMS, PROFILES
from grader.sandbox.policy import SECRET_SEED_FILE_VARIABLE, SECRET_SEED_VARIABLE
from grader.session.report import machine_description, points

RESULTS_MD = ROOT / "benchmarks" / "results" / "grading_time.md"
RESULTS_JSON = ROOT / "benchmarks" / "results" / "grading_time.json"
# The same secret seed on every machine, so that grading-profile times compare the same drawn inputs.
BENCHMARK_SEED = "20250101"
WHOLE = "whole"  # the row of the one run over every selected problem
MODES = ("problems", WHOLE)


def pytest_command(targets: list[str], impl: str, profile: str, timeout_scale: float, results: Path,
                   lanes: int) -> list[str]:
    return [sys.executable, "-m", "pytest", *targets, "-q", "-p", "no:cacheprovider", "--impl", impl,
            "--profile", profile, "--timeout-scale", str(timeout_scale), "--results-json", str(results),
            "--jobs", str(lanes)]


def grader_environment(profile: str) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items()
                   if key not in (SECRET_SEED_VARIABLE, SECRET_SEED_FILE_VARIABLE)}  # a seed file would win over ours
    if profile == "grading":
        environment[SECRET_SEED_VARIABLE] = BENCHMARK_SEED
    return environment


def timed_grade(targets: list[str], results: Path, impl: str, profile: str, timeout_scale: float,
                lanes: int = 1) -> dict:
    """One grader run: its wall time, exit status and, where it wrote results, score and tests by status."""
    started = time.monotonic()
    done = subprocess.run(pytest_command(targets, impl, profile, timeout_scale, results, lanes), cwd=ROOT,
                          capture_output=True, text=True, env=grader_environment(profile))
    row = {"wall_s": round(time.monotonic() - started, 2), "exit_status": done.returncode}
    if not results.exists():
        print(f"{' '.join(targets)}: no results written (exit status {done.returncode}):\n{done.stdout[-3000:]}"
              f"{done.stderr[-3000:]}", file=sys.stderr, flush=True)
        return row
    data = json.loads(results.read_text())
    statuses = [test.get("status", "skipped") for test in data["tests"]]  # a skipped test carries no status
    return {**row, "score": data["score"], "max_score": sum(test["max_score"] for test in data["tests"]),
            **{status: statuses.count(status) for status in ("passed", "failed", "skipped")},
            "isolation": data["extra_data"].get("isolation"),
            "problem_s": data["extra_data"].get("problem_seconds", {})}


def whole_targets(problems: list[str]) -> list[str]:
    """What students and the cluster run, `pytest grader`, when every problem is selected; else those modules."""
    if set(problems) == {p.id for p in PROBLEMS}:
        return ["grader"]
    return [BY_ID[problem].test_module for problem in problems]


def measure(problems: list[str], modes: list[str], impl: str, profile: str, timeout_scale: float,
            jobs: int, lanes: int) -> dict:
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        def grade(row_name: str, targets: list[str], lanes: int = 1) -> tuple[str, dict]:
            row = timed_grade(targets, Path(scratch) / f"{row_name}.json", impl, profile, timeout_scale, lanes)
            print(f"{impl} {profile} {row_name}: {row_cells(row)}", flush=True)
            return row_name, row

        if "problems" in modes:
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                rows.update(pool.map(grade, problems, [[BY_ID[p].test_module] for p in problems]))
        if WHOLE in modes:  # alone, after the others: no problem's run overlaps it
            rows.update([grade(WHOLE, whole_targets(problems), lanes)])
            rows[WHOLE]["problems"] = len(problems)
    at = revision()
    return {name: {**row, "revision": at} for name, row in rows.items()}


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else "unknown CPU"


def machine() -> dict:
    """Called after the runs: asking torch for the GPU's name starts CUDA in this process, which the runs should not
    share the GPU with."""
    description = machine_description()
    gpus = torch.cuda.device_count() if description["gpu"] else 0
    return {**description, "cpu": cpu_model(), "cores": os.cpu_count(), "gpus": gpus}


def machine_key(description: dict) -> str:
    """What makes timings comparable: the same CPU, cores and GPUs, whatever the host is called."""
    gpu = f"{description['gpus']} x {description['gpu']}" if description["gpu"] else "no GPU"
    return f"{description['cpu']}, {description['cores']} cores, {gpu}"


def revision() -> str:
    done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def score(row: dict) -> str:
    if "score" not in row:
        return f"no results (exit status {row['exit_status']})"
    return f"{points(row['score'])}/{points(row['max_score'])}"


def row_cells(row: dict) -> str:
    tests = f"{row['passed']}/{row['failed']}/{row['skipped']}" if "score" in row else "-"
    return f"{score(row)} | {tests} | {row['wall_s']:.1f}"


def section(record: dict) -> list[str]:
    description, rows = record["machine"], record["rows"]
    isolation = ", ".join(sorted({str(row.get("isolation")) for row in rows.values() if "score" in row}))
    lines = [
        f"## {machine_key(description)}: {record['impl']}, {record['profile']}",
        "",
        f"torch {description['torch']}, triton {description['triton']}, python {description['python']}; "
        f"{record['date']}, revision {revisions(record)}; isolation {isolation or 'unknown'}; "
        f"timeout scale {record['timeout_scale']:g}; per-problem runs {record['jobs']} at a time; the whole run in "
        f"{record.get('lanes', 1)} lane(s)",
        "",
        "| problem | score | tests (passed/failed/skipped) | wall s |",
        "| --- | --- | --- | --- |",
    ]
    per_problem = {problem: row for problem, row in rows.items() if problem != WHOLE}
    lines += [f"| {problem} | {row_cells(row)} |" for problem, row in per_problem.items()]
    if WHOLE in rows:
        lines.append(f"| all {rows[WHOLE].get('problems', len(record['problems']))} in one run | "
                     f"{row_cells(rows[WHOLE])} |")
    summary = []
    if per_problem:
        slowest = max(per_problem, key=lambda problem: per_problem[problem]["wall_s"])
        summary.append(f"per problem: median {statistics.median(r['wall_s'] for r in per_problem.values()):.1f} s, "
                       f"max {per_problem[slowest]['wall_s']:.1f} s ({slowest})")
    if WHOLE in rows:
        summary.append(f"whole run: {rows[WHOLE]['wall_s']:.1f} s")
    return lines + ["", "; ".join(summary), ""] + within_whole_run(rows.get(WHOLE, {}))


def revisions(record: dict) -> str:
    """The revisions the record's rows were measured at (rows kept from an earlier run keep theirs)."""
    return ", ".join(sorted({row.get("revision", record["revision"]) for row in record["rows"].values()}))


def within_whole_run(row: dict) -> list[str]:
    """Each problem's share of the whole run (first test's start to last test's end), from its results file."""
    seconds = row.get("problem_s") or {}
    if max(seconds.values(), default=0.0) < 1.0:  # nothing ran long enough to say which problem took the time
        return []
    lines = ["| problem | s within the whole run |", "| --- | --- |"]
    lines += [f"| {problem} | {value:.1f} |" for problem, value in seconds.items()]
    return lines + ["", f"within the whole run: median {statistics.median(seconds.values()):.1f} s, max "
                        f"{max(seconds.values()):.1f} s ({max(seconds, key=seconds.get)})", ""]


def render(records: dict) -> str:
    lines = [
        "# Grading time",
        "",
        "Wall time of each problem's grader run on its own and of one run over all of them, from "
        "`python benchmarks/grading_time.py`; the grading profile with a fixed benchmark seed. Skipped tests are those "
        "the grader does not run on that machine (such as speed tests without a GPU); they count in no score.",
        "",
    ]
    for by_impl in records.values():
        for by_profile in by_impl.values():
            for record in by_profile.values():
                lines += section(record)
    return "\n".join(lines)


def compare(record: dict) -> list[str]:
    """Per-problem wall time and score of the replaced record next to the new one's."""
    before = record.get("before")
    title = f"{record['impl']} {record['profile']}"
    if before is None:
        return [f"{title}: no earlier record on this machine to compare with"]
    lines = [f"{title}: {before['date']} ({before['revision']}) -> {record['date']} ({record['revision']})",
             "| problem | score before | score after | wall s before | wall s after | after / before |",
             "| --- | --- | --- | --- | --- | --- |"]
    for problem, row in record["rows"].items():
        earlier = before["rows"].get(problem)
        if earlier is None:
            lines.append(f"| {problem} | - | {score(row)} | - | {row['wall_s']:.1f} | - |")
            continue
        lines.append(f"| {problem} | {score(earlier)} | {score(row)} | {earlier['wall_s']:.1f} | {row['wall_s']:.1f} | "
                     f"{row['wall_s'] / earlier['wall_s']:.2f}x |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", default="reference", help="the package graded: reference, student_impl, ...")
    parser.add_argument("--profiles", default=",".join(PROFILES))
    parser.add_argument("--problems", default=",".join(p.id for p in PROBLEMS))
    parser.add_argument("--modes", default=",".join(MODES),
                        help="problems: one grader run per problem; whole: one run over all of them")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="passed to the grader")
    parser.add_argument("--jobs", type=int, default=1,
                        help="per-problem runs at once; above 1 they slow each other and the times say less")
    parser.add_argument("--lanes", type=int, default=1,
                        help="the whole run's --jobs: its problems in this many concurrent lanes "
                             "(grader/session/lanes.py)")
    parser.add_argument("--compare", action="store_true", help="print before vs after for the records replaced")
    args = parser.parse_args()
    problems, profiles, modes = args.problems.split(","), args.profiles.split(","), args.modes.split(",")
    unknown = [name for name in problems if name not in BY_ID] + [name for name in profiles if name not in PROFILES]
    unknown += [name for name in modes if name not in MODES]
    if unknown:
        parser.error(f"unknown problems, profiles or modes: {', '.join(unknown)}")
    date, at = datetime.date.today().isoformat(), revision()  # of the code measured, should it change meanwhile
    measured = {profile: measure(problems, modes, args.impl, profile, args.timeout_scale, args.jobs, args.lanes)
                for profile in profiles}
    description = machine()
    records = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else {}
    by_profile = records.setdefault(machine_key(description), {}).setdefault(args.impl, {})
    for profile, rows in measured.items():
        record = {"machine": description, "impl": args.impl, "profile": profile, "date": date, "revision": at,
                  "timeout_scale": args.timeout_scale, "jobs": args.jobs, "lanes": args.lanes, "problems": problems,
                  "rows": rows}
        if profile in by_profile:
            earlier = by_profile[profile]
            record["before"] = {key: value for key, value in earlier.items() if key != "before"}
            kept = {name: {"revision": earlier["revision"], **row} for name, row in earlier["rows"].items()
                    if name not in rows}
            merged = {**kept, **rows}
            record["rows"] = {name: merged[name] for name in [p.id for p in PROBLEMS] + [WHOLE] if name in merged}
            record["problems"] = [p.id for p in PROBLEMS if p.id in {*earlier["problems"], *problems}]
        by_profile[profile] = record
    RESULTS_JSON.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_JSON.write_text(json.dumps(records, indent=2) + "\n")
    RESULTS_MD.write_text(render(records) + "\n")
    for profile in profiles:
        print("\n".join(section(by_profile[profile])))
        if args.compare:
            print("\n".join(compare(by_profile[profile])) + "\n")


if __name__ == "__main__":
    main()
