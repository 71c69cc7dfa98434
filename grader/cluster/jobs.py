"""Submitting grading jobs through submitit and telling a graded result from an infrastructure failure.

A student's failure (wrong answer, crash, timeout inside a test) is a graded result: the results file exists. Anything
that ends a job without one (cancelled, preempted, node failure, the job's own memory or time limit, a grader that
did not start) is "not graded", never a zero. Node failures and preemptions are resubmitted a bounded number of times.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import submitit

from assignment.registry import PROBLEMS
from grader.cluster.grading_job import GradingRequest
from grader.session import seal

# Slurm's final states that say nothing about the student's code; submitit's local executor says INTERRUPTED.
NOT_GRADED_REASONS = {
    "CANCELLED": "the grading job was cancelled",
    "INTERRUPTED": "the grading job was cancelled",
    "PREEMPTED": "the grading job was preempted",
    "NODE_FAIL": "the node running the grading job failed",
    "BOOT_FAIL": "the node for the grading job failed to boot",
    "OUT_OF_MEMORY": "the grading job ran out of memory",
    "TIMEOUT": "the grading job reached its time limit",
    "DEADLINE": "the grading job reached its deadline",
    "REVOKED": "the grading job was revoked",
}
RESUBMITTED_STATES = ("PREEMPTED", "NODE_FAIL")
POLL_S = 2.0
# How long past its time limit a job may stay unfinished before the caller stops waiting (scheduler trouble).
PATIENCE_S = 300.0


@dataclass
class ClusterOptions:
    executor: str  # "slurm" or "local"
    partition: str | None = None
    gpus: int = 0
    tasks: int = 1
    time_limit_min: int = 60
    parallelism: int = 4
    max_resubmissions: int = 2

    @classmethod
    def tasks_for(cls, problem_ids: list[str] | None) -> int:
        """One task per rank of the largest world size among the selected problems (ranks are job-step tasks)."""
        selected = [p for p in PROBLEMS if problem_ids is None or p.id in problem_ids]
        return max([1, *(max(p.world_sizes, default=1) for p in selected)])


def default_executor() -> str:
    return "slurm" if shutil.which("sbatch") else "local"


def make_executor(options: ClusterOptions, folder: Path) -> submitit.Executor:
    """A fresh folder for every submission: a reused one can hand back stale results when job ids repeat."""
    if folder.exists():
        raise FileExistsError(f"{folder} exists: every grading job gets a new submitit folder")
    executor = submitit.AutoExecutor(folder=folder, cluster=options.executor)
    parameters = dict(timeout_min=options.time_limit_min, nodes=1, tasks_per_node=1)
    if options.executor == "slurm":
        # The allocation holds a task per rank, which srun job steps use for parallel problems; without submitit's
        # srun, one process (pytest) runs in it.
        parameters.update(
            tasks_per_node=options.tasks,
            slurm_use_srun=False,
            slurm_array_parallelism=options.parallelism,
        )
        if options.partition:
            parameters["slurm_partition"] = options.partition
        if options.gpus:
            parameters["gpus_per_node"] = options.gpus
    executor.update_parameters(**parameters)
    return executor


def new_folder(parent: Path, prefix: str) -> Path:
    return parent / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


UNSETTLED_STATES = ("UNKNOWN", "PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING")
SETTLE_S = 30.0


def state_of(job: submitit.Job, fresh: bool = False) -> str:
    """The job's state as one word (Slurm writes e.g. "CANCELLED by 0"); `fresh` asks the scheduler now rather than
    reading submitit's cache, which lags by seconds."""
    try:
        if fresh and isinstance(job, submitit.SlurmJob):
            return job.get_info(mode="force").get("State", "UNKNOWN").split()[0].upper()
        return job.state.split()[0].upper()
    except Exception:  # noqa: BLE001 - the scheduler may not answer; the caller keeps waiting within its limit
        return "UNKNOWN"


def final_state(job: submitit.Job) -> str:
    """The state once the scheduler has settled it: a job can be done (its process gone) a moment before that."""
    deadline = time.monotonic() + SETTLE_S
    state = state_of(job, fresh=True)
    while state in UNSETTLED_STATES and time.monotonic() < deadline:
        time.sleep(POLL_S)
        state = state_of(job, fresh=True)
    return state


@dataclass
class Outcome:
    graded: bool
    state: str
    reason: str = ""
    results: dict | None = None

    @property
    def resubmittable(self) -> bool:
        return not self.graded and self.state in RESUBMITTED_STATES


GRADED_EXIT_STATUSES = (0, 1)  # pytest: every test passed, or some failed


def exit_status_of(job: submitit.Job) -> int | None:
    """The grading function's return value: pytest's exit status. Only task 0 runs it (the job's other tasks are
    slots for ranks), so only its result is read."""
    try:
        return int(job.task(0).result())
    except Exception:  # noqa: BLE001 - a job that failed, was cancelled or never ran has no status
        return None


def outcome(job: submitit.Job, request: GradingRequest) -> Outcome:
    """Graded only with a results file that this run's grader signed and a grader that exited with 0 or 1."""
    results_path = Path(request.results_json)
    state = state_of(job) if results_path.exists() else final_state(job)
    if results_path.exists():
        status = exit_status_of(job)
        if status not in GRADED_EXIT_STATUSES:
            return Outcome(False, state, f"results failed verification: the grader exited with status "
                                         f"{status} (see {job.paths.stdout})")
        try:
            results = json.loads(results_path.read_text())
        except (OSError, json.JSONDecodeError):
            return Outcome(False, state, "results failed verification: the results file is not JSON")
        why = seal.verify(results, request.key(), request.nonce) if isinstance(results, dict) else "not an object"
        if why is not None:
            return Outcome(False, state, f"results failed verification: {why}")
        return Outcome(True, state, results=results)
    reason = NOT_GRADED_REASONS.get(state)
    if reason is None:
        reason = f"the grading job ended ({state}) without results: the grader failed to start; see {job.paths.stdout}"
    return Outcome(False, state, reason)


def wait(jobs: list[submitit.Job], options: ClusterOptions, report=print) -> None:
    """Until every job is done, reporting state changes; gives up (cancelling) well past the time limit."""
    deadline = time.monotonic() + options.time_limit_min * 60 + PATIENCE_S
    seen: dict[str, str] = {}
    while True:
        pending = [job for job in jobs if not job.done()]
        for job in jobs:
            state = state_of(job)
            if seen.get(job.job_id) != state:
                seen[job.job_id] = state
                report(f"job {job.job_id}: {state}")
        if not pending:
            return
        if time.monotonic() > deadline:
            for job in pending:
                job.cancel(check=False)
            report(f"gave up waiting for {len(pending)} job(s) {options.time_limit_min} min past their time limit")
            return
        time.sleep(POLL_S)
