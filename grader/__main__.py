"""Command line: `python -m grader submit` (one submission), `python -m grader grade-all` (a whole class),
`python -m grader gradescope OUT.zip` (a Gradescope autograder), `python -m grader release OUT` (the students' copy)
and `python -m grader check-isolation` (which sandbox student code gets on this machine). The students' copy lacks
the instructor's commands (gradescope, release).

Both run on Slurm through submitit when `sbatch` is on the PATH, and through submitit's local executor otherwise
(`--executor` chooses explicitly).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from assignment.registry import problem_ids
from grader.cluster.jobs import ClusterOptions, default_executor

# The instructor's commands and their modules, absent from the students' copy.
INSTRUCTOR_COMMANDS = {"gradescope": "grader.release.gradescope", "release": "grader.release.students_copy"}


def problem_selection(problems: str | None, select: str | None) -> tuple[list[str] | None, tuple[str, ...]]:
    """`--problems kernels.softmax,parallel.ddp` -> those ids, and the pytest arguments that grade exactly them (and
    only the tests matching `--select`, a -k expression). Raises ValueError for an id the registry lacks."""
    ids = problem_ids(problems or "") or None
    arguments = ("--problem", ",".join(ids)) if ids else ()
    return ids, arguments + (("-k", select) if select else ())


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reference", default=os.environ.get("GRADER_REFERENCE", "reference"),
                        help="the reference to grade against (a directory; env GRADER_REFERENCE)")
    parser.add_argument("--profile", default="public", choices=("public", "grading", "ci"))
    parser.add_argument("--executor", default=default_executor(), choices=("slurm", "local"),
                        help="slurm when sbatch is found, else local (submitit's local executor)")
    parser.add_argument("--partition", help="Slurm partition")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per job (0: grade on CPUs, gloo ranks)")
    parser.add_argument("--time-limit", type=int, default=60, help="minutes per grading job")
    parser.add_argument("--problems", help="comma-separated problem ids to grade (default: all)")
    parser.add_argument("--select", help="grade only the tests matching this pytest -k expression")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiply the grader's time limits")
    parser.add_argument("--max-resubmissions", type=int, default=2,
                        help="times a job ended by node failure or preemption is submitted again")
    parser.add_argument("--isolation", default="auto", choices=("auto", "bwrap", "uid", "none"),
                        help="sandbox for student code on the grading node (see the README's 'Isolation')")
    parser.add_argument("--allow-unisolated", action="store_true",
                        help="grade even where the node offers no sandbox (student code then runs as your user)")


def options_from(args: argparse.Namespace, problem_ids: list[str] | None, parallelism: int = 1) -> ClusterOptions:
    return ClusterOptions(
        executor=args.executor,
        partition=args.partition,
        gpus=args.gpus,
        tasks=ClusterOptions.tasks_for(problem_ids),
        time_limit_min=args.time_limit,
        parallelism=parallelism,
        max_resubmissions=args.max_resubmissions,
    )


def reference_path(value: str) -> str:
    """The reference's directory; "" in the students' copy, where the cluster's site file chooses it (and the profile
    and seed) on the node that grades (grader.cluster.site)."""
    from grader.expectations import students_copy_folder
    from grader.session.packages import resolve

    try:
        return str(resolve(value, [str(Path.cwd()), str(Path(__file__).resolve().parent.parent)]).path)
    except ValueError:
        if students_copy_folder() is not None and value == "reference":
            return ""
        raise


def check_isolation() -> int:
    """0 when student code would run in a bwrap sandbox here, 1 otherwise (the level it would get is printed)."""
    from grader.sandbox import isolation

    works, why = isolation.bwrap_works()
    level, note = isolation.choose("auto")
    print(f"isolation: {level}" + (f" ({note})" if note else ""))
    if not works:
        print(f"bwrap: {why}")
    return 0 if level == "bwrap" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grader", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    submit_parser = commands.add_parser("submit", help="grade one submission as a cluster job")
    submit_parser.add_argument("--impl", default="student_impl", help="the implementation to grade (a directory)")
    submit_parser.add_argument("--results-json", default="results.json", help="where to save the results")
    submit_parser.add_argument("--work-dir", default=os.path.expanduser("~/.cache/grader/submissions"),
                               help="where snapshots and job folders go (must be visible to the cluster's nodes)")
    add_common(submit_parser)

    all_parser = commands.add_parser("grade-all", help="grade every submission of a class in one array job")
    all_parser.add_argument("submissions", type=Path, help="a folder with one implementation folder per student")
    all_parser.add_argument("--out", type=Path, required=True, help="results folder (re-runs grade what changed)")
    all_parser.add_argument("--parallel", type=int, default=4, help="grading jobs running at once")
    add_common(all_parser)

    commands.add_parser("check-isolation", help="say which sandbox student code would get on this machine, and why")
    instructor_commands = {}
    # The students' copy has no grader/release/. Looked for beside this file, not imported on the chance: a Python
    # that also has the instructor's repository installed would find that one's.
    if (Path(__file__).parent / "release").is_dir():
        for name, module in INSTRUCTOR_COMMANDS.items():
            instructor_commands[name] = importlib.import_module(module)
            instructor_commands[name].add_command(commands)

    args = parser.parse_args(argv)
    if args.command == "check-isolation":
        return check_isolation()
    if args.command in instructor_commands:
        try:
            return instructor_commands[args.command].build_command(args)
        except (ValueError, RuntimeError) as error:
            parser.error(str(error))
    if args.isolation == "none" and not args.allow_unisolated:
        parser.error("--isolation none lets student code read and rewrite results: add --allow-unisolated to insist")
    try:
        problem_ids, pytest_args = problem_selection(args.problems, args.select)
    except ValueError as error:
        parser.error(str(error))
    try:
        reference = reference_path(args.reference)
    except ValueError as error:
        parser.error(str(error))
    if args.command == "submit":
        if not reference:
            print("the cluster grades with the course's reference and profile (its site file), not this copy's "
                  "--profile")
        from grader.cluster.submit import exit_status, submit

        result = submit(
            Path(args.impl), reference, options_from(args, problem_ids), Path(args.work_dir),
            Path(args.results_json), args.profile, pytest_args, args.timeout_scale, args.isolation,
            args.allow_unisolated,
        )
        return exit_status(result)
    from grader.cluster.grade_all import grade_all

    rows = grade_all(
        args.submissions, args.out, reference, options_from(args, problem_ids, args.parallel), args.profile,
        pytest_args, args.timeout_scale, args.isolation, args.allow_unisolated, problem_ids=problem_ids,
    )
    return 0 if all(row["status"] == "graded" for row in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
