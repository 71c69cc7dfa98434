"""What a student process may see of the grader's environment: the one list of secret variables, and the environment
every student process (worker, rank, launcher host) starts with. The sandbox and the launchers take both from here."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]

SECRET_SEED_VARIABLE = "GRADER_SECRET_SEED"
SECRET_SEED_FILE_VARIABLE = "GRADER_SECRET_SEED_FILE"
REFERENCE_VARIABLE = "GRADER_REFERENCE"
RESULTS_KEY_FILE_VARIABLE = "GRADER_RESULTS_KEY_FILE"
SITE_FILE_VARIABLE = "GRADER_SITE_FILE"
# Variables a student process must not see: the grading seed would let it predict the inputs, the reference path
# would tell it where the solutions are, the key file where results are signed, the site file where both are named.
SECRET_VARIABLES = (SECRET_SEED_VARIABLE, SECRET_SEED_FILE_VARIABLE, REFERENCE_VARIABLE, RESULTS_KEY_FILE_VARIABLE,
                    SITE_FILE_VARIABLE)

# One CPU thread for every student process (worker, rank). They compute on small tensors, where a pool of threads per
# operation costs more than it saves, and several of them at once (the ranks of a launch, a worker beside the grader)
# each starting a thread per core oversubscribe the machine. Measured in a 2-rank launch, 2,000 tanh(a @ a) of 64 x 64:
# 0.03 s with one thread against 35 s with sixteen (16-core GPU host), 0.04 s against 0.1-20 s with two (2 cores).
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def without_secrets(environment: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environment.items() if k not in SECRET_VARIABLES}


def student_environment() -> dict[str, str]:
    """The grader's environment without its secrets, with the grader's code importable and one thread per process."""
    env = without_secrets(os.environ)
    env.update(ONE_THREAD)
    env["PYTHONPATH"] = os.pathsep.join([str(REPOSITORY), env.get("PYTHONPATH", "")])
    return env
