"""`python -m grader grade-all`: every submission of a class in one array job, then a class CSV and a summary.

Layout of the output folder, per student: `<student>/results.json` (Gradescope format), `<student>/submission.sha256`
(the hash of what was graded) or `<student>/not_graded.txt`, and `<student>/runs/<run>/` (snapshot, job folder).
Re-running grades only the submissions without results or whose content changed.
"""

from __future__ import annotations

import csv
import json
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

from assignment.registry import PROBLEMS, Problem
from grader.cluster.grading_job import GradingRequest, run_grading
from grader.cluster.jobs import ClusterOptions, Outcome, make_executor, new_folder, outcome, wait
from grader.sandbox.submission import BadSubmission, read


@dataclass
class Submission:
    student: str
    source: Path
    out: Path  # the student's folder in the output

    @property
    def results(self) -> Path:
        return self.out / "results.json"

    @property
    def hash_file(self) -> Path:
        return self.out / "submission.sha256"

    @property
    def not_graded(self) -> Path:
        return self.out / "not_graded.txt"

    def up_to_date(self) -> bool:
        if not (self.results.exists() and self.hash_file.exists()):
            return False
        try:
            return self.hash_file.read_text() == read(self.source).digest()
        except BadSubmission:
            return False  # graded again, to be refused with its reason


def submissions_in(directory: Path, out: Path) -> list[Submission]:
    """A submission per folder, and per link: a link is never followed, and is refused when graded (not graded, with
    the reason), so that it shows in the class table."""
    return [
        Submission(path.name, path, out / path.name)
        for path in sorted(directory.iterdir())
        if (path.is_symlink() or path.is_dir()) and not path.name.startswith(".")
    ]


def record(submission: Submission, graded_hash: str, result: Outcome, results_path: Path) -> None:
    if result.graded:
        forget_results(submission)
        shutil.copy(results_path, submission.results)
        submission.hash_file.write_text(graded_hash)
    else:
        record_not_graded(submission, result.reason)


def record_not_graded(submission: Submission, reason: str) -> None:
    forget_results(submission)
    submission.not_graded.write_text(reason + "\n")


def forget_results(submission: Submission) -> None:
    submission.out.mkdir(parents=True, exist_ok=True)
    submission.results.unlink(missing_ok=True)
    submission.hash_file.unlink(missing_ok=True)
    submission.not_graded.unlink(missing_ok=True)


def grade(submissions: list[Submission], reference: str, options: ClusterOptions, out: Path, profile: str,
          pytest_args: tuple[str, ...], timeout_scale: float, isolation: str, allow_unisolated: bool,
          report) -> None:
    """One array job over the submissions; node failures and preemptions are resubmitted, a bounded number of times.
    A submission the grader won't read (a link, say) is not graded, with the reason, and the others go on."""
    for round_number in range(1 + options.max_resubmissions):
        submitted, requests, hashes = [], [], []
        for submission in submissions:
            try:
                tree = read(submission.source)
            except BadSubmission as error:
                record_not_graded(submission, str(error))
                report(f"{submission.student}: not graded: {error}")
                continue
            run_dir = new_folder(submission.out / "runs", "run")
            submitted.append(submission)
            hashes.append(tree.digest())
            # Each job sees its own snapshot (read-only inside the sandbox) and writes only its own run folder.
            requests.append(GradingRequest.in_folder(
                run_dir, tree.write_to(run_dir / submission.source.name), reference=reference, profile=profile,
                pytest_args=pytest_args, timeout_scale=timeout_scale, isolation=isolation,
                allow_unisolated=allow_unisolated,
            ))
        if not submitted:
            return
        executor = make_executor(options, new_folder(out / ".jobs", "array"))
        jobs = executor.map_array(run_grading, requests)
        report(f"submitted {len(jobs)} submissions as one array job ({options.executor}), "
               f"at most {options.parallelism} at once")
        wait(jobs, options, report=report)
        again = []
        for submission, job, request, graded_hash in zip(submitted, jobs, requests, hashes):
            result = outcome(job, request)
            if result.resubmittable and round_number < options.max_resubmissions:
                report(f"{submission.student}: {result.reason}: resubmitting")
                again.append(submission)
                continue
            record(submission, graded_hash, result, Path(request.results_json))
            report(f"{submission.student}: " + (f"graded, {result.results['score']:g} points" if result.graded
                                                 else f"not graded: {result.reason}"))
        submissions = again


def selected_problems(problem_ids: list[str] | None) -> list[Problem]:
    """The problems a run grades, in the registry's order: those named by `--problems`, or all of them."""
    return [problem for problem in PROBLEMS if problem_ids is None or problem.id in problem_ids]


def points_by_problem(results: dict, problems: list[Problem]) -> dict[str, float]:
    """Points per selected problem. A selected problem none of whose tests ran (a `--select` that matched none)
    still has its column, at 0; tests of a problem not selected have no column to go to."""
    points = {problem.id: 0.0 for problem in problems}
    for test in results["tests"]:
        problem_id = test["name"].split(" :: ")[0]
        if problem_id in points:
            points[problem_id] += test["score"]
    return points


def write_class_csv(submissions: list[Submission], out: Path, problems: list[Problem]) -> list[dict]:
    """class.csv: a row per student with the points of each selected problem (only those: a column of zeros for a
    problem nobody was graded on would read as a class that failed it), the total and the status."""
    rows = []
    for submission in submissions:
        row = {"student": submission.student}
        if submission.results.exists() and not submission.not_graded.exists():
            results = json.loads(submission.results.read_text())
            row.update({pid: f"{pts:g}" for pid, pts in points_by_problem(results, problems).items()})
            row["total"] = f"{results['score']:g}"
            row["status"] = "graded"
        else:
            reason = submission.not_graded.read_text().strip() if submission.not_graded.exists() else "no result"
            row.update({problem.id: "" for problem in problems})
            row["total"] = ""
            row["status"] = f"not graded: {reason}"
        rows.append(row)
    with open(out / "class.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["student", *(p.id for p in problems), "total", "status"])
        writer.writeheader()
        writer.writerows(rows)
    return rows


def summary(rows: list[dict], problems: list[Problem]) -> str:
    graded = [r for r in rows if r["status"] == "graded"]
    lines = [f"{len(rows)} submissions: {len(graded)} graded, {len(rows) - len(graded)} not graded"]
    if graded:
        totals = [float(r["total"]) for r in graded]
        lines.append(f"total: mean {statistics.mean(totals):.2f}, median {statistics.median(totals):.2f}, "
                     f"min {min(totals):g}, max {max(totals):g}")
        for problem in problems:
            scores = [float(r[problem.id]) for r in graded]
            lines.append(f"{problem.id}: mean {statistics.mean(scores):.2f} of {problem.max_points:g}")
    lines += [f"{r['student']}: {r['status']}" for r in rows if r["status"] != "graded"]
    return "\n".join(lines)


def grade_all(submissions_dir: Path, out: Path, reference: str, options: ClusterOptions, profile: str = "public",
              pytest_args: tuple[str, ...] = (), timeout_scale: float = 1.0, isolation: str = "auto",
              allow_unisolated: bool = False, problem_ids: list[str] | None = None, report=print) -> list[dict]:
    """Grade the submissions that need it and write class.csv and summary.txt for the problems in `problem_ids`
    (all of them when None), which must be the problems `pytest_args` selects."""
    problems = selected_problems(problem_ids)
    out.mkdir(parents=True, exist_ok=True)
    submissions = submissions_in(submissions_dir, out)
    stale = [s for s in submissions if not s.up_to_date()]
    report(f"{len(submissions)} submissions, {len(submissions) - len(stale)} already graded and unchanged")
    grade(stale, reference, options, out, profile, pytest_args, timeout_scale, isolation, allow_unisolated, report)
    rows = write_class_csv(submissions, out, problems)
    text = summary(rows, problems)
    (out / "summary.txt").write_text(text + "\n")
    report(text)
    report(f"class table: {out / 'class.csv'}")
    return rows
