"""What runs inside a grading job: `pytest grader` on a snapshot, its results file written where the caller reads it.

The job's function returns only an exit code; verdicts travel in the results file, which the caller reads as JSON.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class GradingRequest:
    impl: str  # the snapshot directory
    reference: str
    results_json: str
    profile: str = "public"
    pytest_args: tuple[str, ...] = ()
    timeout_scale: float = 1.0
    environment: dict[str, str] = field(default_factory=dict)

    def command(self, launcher: str) -> list[str]:
        return [
            sys.executable, "-m", "pytest", "grader", "-p", "no:cacheprovider", "-p", "no:warnings", "-q",
            "--impl", self.impl, "--reference", self.reference, "--profile", self.profile,
            "--results-json", self.results_json, "--launcher", launcher,
            "--timeout-scale", str(self.timeout_scale), *self.pytest_args,
        ]  # fmt: skip


def run_grading(request: GradingRequest) -> int:
    """Grade one snapshot; inside a Slurm job the distributed problems' ranks are tasks of a job step."""
    launcher = "srun" if "SLURM_JOB_ID" in os.environ and os.environ.get("SUBMITIT_EXECUTOR") == "slurm" else "local"
    results = Path(request.results_json)
    results.unlink(missing_ok=True)  # only this run's results may be read back
    env = {**os.environ, **request.environment}
    completed = subprocess.run(request.command(launcher), cwd=REPOSITORY, env=env, stdin=subprocess.DEVNULL)
    return completed.returncode
