"""What the sandbox costs: the reference's public grade of a few problems, timed without isolation at an earlier
revision (before the sandbox existed) and with each isolation level now, on this machine.

    python benchmarks/isolation_overhead.py [--before REV] [--problems kernels.gelu,moe.router,parallel.ddp]
        [--levels none,bwrap] [--rounds 1]

The earlier revision is checked out into a temporary git worktree and graded with its own grader. Runs alternate
(before, then each level, per round) so that drift in the machine's load spreads over all of them. Writes
benchmarks/results/isolation_overhead.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "isolation_overhead.md"


def selection(problems: list[str], before: bool) -> list[str]:
    """The pytest arguments that grade `problems`: --problem now; in the earlier revision, which had no --problem and
    one grader/test_<family>_<name>.py per problem, -k on those names."""
    if before:
        return ["-k", " or ".join(p.replace(".", "_") for p in problems)]
    return ["--problem", ",".join(problems)]


def grade_seconds(tree: Path, problems: list[str], extra: list[str], before: bool = False) -> float:
    command = [sys.executable, "-m", "pytest", "grader", "-q", "-p", "no:cacheprovider", "--impl", "reference",
               "--reference", "reference", "--profile", "public", *selection(problems, before), *extra]
    started = time.monotonic()
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tree)})
    elapsed = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"the reference did not pass in {tree} ({' '.join(extra)}):\n{done.stdout[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="460f2df", help="a revision before the sandbox")
    parser.add_argument("--problems", default="kernels.gelu,moe.router,parallel.ddp")
    parser.add_argument("--levels", default="none,bwrap")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    problems, levels = args.problems.split(","), args.levels.split(",")
    with tempfile.TemporaryDirectory() as scratch:
        before = Path(scratch) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            times = {"before": [], **{level: [] for level in levels}}
            for _ in range(args.rounds):
                times["before"].append(grade_seconds(before, problems, [], before=True))
                for level in levels:
                    times[level].append(grade_seconds(ROOT, problems, ["--isolation", level]))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, capture_output=True)
    base = statistics.median(times["before"])
    lines = [
        "# Isolation overhead",
        "",
        f"Public grade of the reference for {', '.join(problems)}; median of {args.rounds} run(s) each, alternating.",
        f"Machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}, "
        f"Python {platform.python_version()}.",
        f"Before: revision {args.before} (no sandbox). The grader has changed since in more than its sandbox, so the "
        "sandbox's own cost is each level against `none`, the same grader with no sandbox.",
        "",
        "| run | seconds | vs before | vs none |",
        "| --- | --- | --- | --- |",
        f"| before | {base:.1f} | 1.00x | |",
    ]
    unsandboxed = statistics.median(times["none"]) if "none" in times else None
    for level in levels:
        median = statistics.median(times[level])
        against_none = f"{median / unsandboxed:.2f}x" if unsandboxed else ""
        lines.append(f"| --isolation {level} | {median:.1f} | {median / base:.2f}x | {against_none} |")
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
