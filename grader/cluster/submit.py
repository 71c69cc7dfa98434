"""`python -m grader submit`: grade one submission as a cluster job and print the same score table as
`pytest grader`."""

from __future__ import annotations

import shutil
from pathlib import Path

from grader.cluster.grading_job import GradingRequest, run_grading
from grader.cluster.jobs import ClusterOptions, Outcome, make_executor, new_folder, outcome, wait
from grader.sandbox.submission import BadSubmission, read


def tail_printer(path_of, report):
    """Prints the lines a job's log gained since the last call: the grader's progress while the job runs."""
    printed = {"bytes": 0}

    def show(message: str = "") -> None:
        if message:
            report(message)
        try:
            with open(path_of(), "rb") as log:
                log.seek(printed["bytes"])
                new = log.read()
        except OSError:
            return
        printed["bytes"] += len(new)
        for line in new.decode(errors="replace").splitlines():
            report(f"  | {line}")

    return show


def submit(
    impl: Path,
    reference: str,
    options: ClusterOptions,
    work_dir: Path,
    results_json: Path,
    profile: str = "public",
    pytest_args: tuple[str, ...] = (),
    timeout_scale: float = 1.0,
    isolation: str = "auto",
    allow_unisolated: bool = False,
    report=print,
) -> Outcome:
    """Read `impl` once, grade it in a job (resubmitting after node failures or preemption, each time from what was
    read), save its results. A submission the grader won't read (a link, say) is not graded, and no job submitted."""
    try:
        submission = read(impl)
    except BadSubmission as error:
        report(f"not graded: {error}")
        return Outcome(False, "NOT_SUBMITTED", str(error))
    attempt = Outcome(False, "NOT_SUBMITTED", "not submitted")
    for _ in range(1 + options.max_resubmissions):
        run_dir = new_folder(work_dir, impl.resolve().name)
        request = GradingRequest.in_folder(
            run_dir, submission.write_to(run_dir / impl.resolve().name), reference=reference, profile=profile,
            pytest_args=pytest_args, timeout_scale=timeout_scale, isolation=isolation,
            allow_unisolated=allow_unisolated,
        )
        executor = make_executor(options, run_dir / "submitit")
        job = executor.submit(run_grading, request)
        report(f"submitted {impl} as job {job.job_id} ({options.executor}); work folder {run_dir}")
        show = tail_printer(lambda: job.paths.stdout, report)
        try:
            wait([job], options, report=lambda message: show(message))
        except KeyboardInterrupt:
            job.cancel(check=False)
            report(f"cancelled job {job.job_id}")
            return Outcome(False, "CANCELLED", "cancelled from the keyboard: not graded")
        show()
        attempt = outcome(job, request)
        if not attempt.resubmittable:
            break
        report(f"{attempt.reason}: resubmitting")
    if attempt.graded:
        results_json.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(request.results_json), results_json)
        report(attempt.results["output"])
        report(f"results saved to {results_json}")
    else:
        report(f"not graded: {attempt.reason}")
    return attempt


def exit_status(result: Outcome) -> int:
    """0 when graded with full marks, 1 when graded with any loss, 2 when not graded."""
    if not result.graded:
        return 2
    tests = result.results["tests"]
    return 0 if all(t.get("status", "passed") == "passed" for t in tests) else 1
