"""How stable the speed verdicts are: the reference graded against itself, many times, on one GPU.

    python benchmarks/speed_stability.py [--runs 20] [--problems kernels.softmax,...] [--isolation auto]
        [--case "((256, 1024), 'float32')" --out benchmarks/results/speed_stability_small.md]

For every problem with speed thresholds and every benchmark case, the reference is timed as if it were a student's
submission (in a sandboxed worker process, exactly as `pytest grader` does) against itself, `--runs` times. Each
run's ratio should be near 1 and its tier the top one; a run in any other tier is a verdict that would flip. Writes
benchmarks/results/speed_stability.md.

`--case` times one case of your choosing in place of the registry's, for every problem chosen: at a small,
launch-bound case a ratio above 1 is time the worker adds to each call that the grader's own process does not.
"""

from __future__ import annotations

import argparse
import ast
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch
import triton

from assignment.registry import PROBLEMS
from grader.checks import profiles
from grader.sandbox import isolation
from grader.sandbox.client import Sandbox
from grader.session.packages import load_problem_module, resolve
from grader.speed.grading import speed_spec


def reference_sandbox(problem, reference, sandbox_isolation: isolation.Isolation) -> Sandbox:
    """The reference of `problem` behind a worker, under that problem's rules, as `pytest grader` runs a student's."""
    return Sandbox(problem.id, reference, reference, isolation=sandbox_isolation, call_timeout_s=600,
                   forbidden_ops=problem.forbidden_ops, uses_triton=problem.uses_triton)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--problems", help="comma-separated problem ids (default: every problem with speed points)")
    parser.add_argument("--isolation", default="auto", choices=isolation.REQUESTS,
                        help="the worker's sandbox, as pytest grader's --isolation (default: auto)")
    parser.add_argument("--case", type=ast.literal_eval, help="time this case, e.g. \"((256, 1024), 'float32')\", "
                        "in place of the registry's cases")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "speed_stability.md")
    args = parser.parse_args()
    profiles.load("public")
    level, _ = isolation.choose(args.isolation)
    sandbox_isolation = isolation.Isolation(level, gpu=True)
    reference = resolve(str(ROOT / "reference"))
    lines = ["| problem | case | ratios (min / median / max) | runs not in the top tier |", "| --- | --- | --- | --- |"]
    flips = 0
    chosen = args.problems.split(",") if args.problems else [p.id for p in PROBLEMS]
    for problem in (p for p in PROBLEMS if p.speed is not None and p.id in chosen):
        spec = speed_spec(problem.id)
        if spec is None:  # distributed problems time whole training steps over several GPUs
            print(f"{problem.id}: timed by its grader's test_speed on several GPUs, not here", flush=True)
            continue
        reference_module = load_problem_module(reference, problem.id)
        sandbox = reference_sandbox(problem, reference, sandbox_isolation)
        try:
            for case in [args.case] if args.case else problem.speed.cases():
                verdicts = [spec.run(sandbox, reference_module, case, problem.speed, seed=run)
                            for run in range(args.runs)]
                ratios = sorted(v.ratio for v in verdicts)
                off_top = sum(v.fraction != problem.speed.tiers[0][1] for v in verdicts)
                flips += off_top
                lines.append(f"| {problem.id} | {case[0]} {case[1]} | {ratios[0]:.3f} / "
                             f"{ratios[len(ratios) // 2]:.3f} / {ratios[-1]:.3f} | {off_top} of {args.runs} |")
                print(lines[-1], flush=True)
        finally:
            sandbox.close()
    sandbox_isolation.close()
    versions = (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
                f"python {platform.python_version()}; the worker's isolation: {level}")
    report = "\n".join(["# Speed verdicts of the reference against itself", "", versions, "", *lines, "",
                        f"verdicts that would flip: {flips}", ""])
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    sys.exit(1 if flips else 0)


if __name__ == "__main__":
    main()
