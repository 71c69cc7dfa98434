"""How much of a problem's grading time is Triton compiling its kernels: the problem graded twice with one Triton cache,
first empty (every kernel compiled, as in a real grading, whose sandbox starts with an empty cache) and then full
(nothing compiled), test by test.

    python benchmarks/compile_share.py PROBLEM [--profile public] [-k EXPRESSION] [--impl reference]
        [--timeout 300]

Both runs draw the same inputs (the grading profile from a fixed seed; public and ci are derandomised) and grade
outside the sandbox (--isolation none): the sandbox gives each grading a Triton cache of its own, so a second run in
it would compile everything again. The grader's reference, in the grader's own process, shares the cache too, so
the cold run pays both sides' compilation, as a grading does. Printed per test: the cold and the warm seconds and
their difference (compilation, with whatever else only a first call pays), and the kernels the cold run compiled.
A run stopped by --timeout is interrupted as Ctrl-C would (its finished tests are kept), so a slow problem still
shows where its first minutes went. Under Triton's interpreter nothing is compiled and both runs take about as long.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.grading_time import grader_environment

GRACE_S = 60  # after the interrupt, for pytest to write its report


def grade(problem: str, profile: str, impl: str, selection: str | None, cache: Path, timeout_s: float,
          report: Path) -> dict[str, float]:
    """Seconds per test (setup, call and teardown) of one grader run with `cache` as its Triton cache."""
    command = [sys.executable, "-m", "pytest", "grader", "-q", "-p", "no:cacheprovider", "--problem", problem,
               "--impl", impl, "--profile", profile, "--isolation", "none", "--allow-unisolated",
               "--junitxml", str(report), *(["-k", selection] if selection else [])]
    environment = {**grader_environment(profile), "TRITON_CACHE_DIR": str(cache)}
    run = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        run.wait(timeout_s)
    except subprocess.TimeoutExpired:
        run.send_signal(signal.SIGINT)
        try:
            run.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait()
    if not report.exists():
        return {}
    cases = ElementTree.parse(report).iter("testcase")  # an interrupted run adds one without a name
    return {case.get("name"): float(case.get("time", 0)) for case in cases if case.get("name")}


def compiled_kernels(cache: Path) -> int:
    """Kernels in a Triton cache: one metadata file each (the group files list a kernel's files, not kernels)."""
    return sum(1 for path in cache.rglob("*.json") if not path.name.startswith("__grp__"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problem", help="e.g. attention.gated_deltanet")
    parser.add_argument("--profile", default="public")
    parser.add_argument("--impl", default="reference")
    parser.add_argument("-k", dest="selection", default=None, help="pytest's -k, to time some tests only")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for each of the two runs")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        cache = Path(scratch) / "triton"
        cold = grade(args.problem, args.profile, args.impl, args.selection, cache, args.timeout,
                     Path(scratch) / "cold.xml")
        kernels = compiled_kernels(cache)
        warm = grade(args.problem, args.profile, args.impl, args.selection, cache, args.timeout,
                     Path(scratch) / "warm.xml")
    print(f"{args.problem}, {args.profile} profile: {kernels} kernels compiled by the cold run\n")
    print("| test | cold s | warm s | cold - warm s |\n| --- | --- | --- | --- |")
    for test, cold_s in cold.items():
        warm_s = warm.get(test)
        shown = f"{warm_s:.1f} | {cold_s - warm_s:.1f}" if warm_s is not None else "not reached | "
        print(f"| {test} | {cold_s:.1f} | {shown} |")
    common = [test for test in cold if test in warm]
    print(f"| all {len(common)} reached twice | {sum(cold[t] for t in common):.1f} | "
          f"{sum(warm[t] for t in common):.1f} | {sum(cold[t] - warm[t] for t in common):.1f} |")
    return 0 if cold else 1


if __name__ == "__main__":
    sys.exit(main())
