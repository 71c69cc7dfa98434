"""What runs inside a grading job: `pytest grader` on a snapshot, its results file written where the caller reads it.

The job's function returns pytest's exit status; verdicts travel in the results file, which the caller accepts only
when that status is 0 or 1 and the file carries this run's signature (see grader.session.seal). The signing key is a
file beside the snapshot, outside every sandbox; only its path is handed to the grader, which removes it from its
environment before any student process starts.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from grader.cluster import site
from grader.sandbox.policy import RESULTS_KEY_FILE_VARIABLE, SECRET_SEED_FILE_VARIABLE
from grader.session import seal

REPOSITORY = Path(__file__).resolve().parents[2]
NO_SITE_STATUS = 4  # not graded: no site file says how (a request from the students' copy)


@dataclass(frozen=True)
class GradingRequest:
    impl: str  # the snapshot directory
    reference: str  # "": the cluster's site file chooses (grader.cluster.site)
    results_json: str
    key_file: str
    nonce: str
    profile: str = "public"
    pytest_args: tuple[str, ...] = ()
    timeout_scale: float = 1.0
    isolation: str = "auto"
    allow_unisolated: bool = False
    environment: dict[str, str] = field(default_factory=dict)

    @classmethod
    def in_folder(cls, run_dir: Path, impl: Path, **settings) -> "GradingRequest":
        """A request whose results and key live in `run_dir`, beside (never inside) the snapshot `impl`."""
        key = seal.new_key(run_dir / "results.key")
        return cls(impl=str(impl), results_json=str(run_dir / "results.json"), key_file=str(key),
                   nonce=secrets.token_hex(16), **settings)

    def key(self) -> bytes:
        return Path(self.key_file).read_text().strip().encode()

    def command(self, launcher: str) -> list[str]:
        return [
            sys.executable, "-m", "pytest", "grader", "-p", "no:cacheprovider", "-p", "no:warnings", "-q",
            "--impl", self.impl, "--reference", self.reference, "--profile", self.profile,
            "--results-json", self.results_json, "--results-nonce", self.nonce, "--launcher", launcher,
            "--timeout-scale", str(self.timeout_scale), "--isolation", self.isolation,
            "--allow-unisolated" if self.allow_unisolated else "--refuse-unisolated", *self.pytest_args,
        ]


def run_grading(request: GradingRequest) -> int:
    """Grade one snapshot; inside a Slurm job the distributed problems' ranks are started by a job step. A request
    that names no reference (from the students' copy) is graded as the cluster's site file says (grader.cluster.site):
    its grader, reference, profile and seed."""
    launcher = "srun" if "SLURM_JOB_ID" in os.environ and os.environ.get("SUBMITIT_EXECUTOR") == "slurm" else "local"
    results = Path(request.results_json)
    results.unlink(missing_ok=True)  # only this run's results may be read back
    env = {**os.environ, **request.environment, RESULTS_KEY_FILE_VARIABLE: request.key_file}
    repository = REPOSITORY
    if not request.reference:
        try:
            settings = site.load()
        except RuntimeError as error:
            print(f"not graded: {error}", flush=True)  # the job's output, which submit shows
            return NO_SITE_STATUS
        request = replace(request, reference=str(settings.reference), profile=settings.profile)
        repository = settings.grader
        if settings.secret_seed_file:
            env[SECRET_SEED_FILE_VARIABLE] = settings.secret_seed_file
    completed = subprocess.run(request.command(launcher), cwd=repository, env=env, stdin=subprocess.DEVNULL)
    return completed.returncode
