"""What this grading run is: the profile, the packages being compared, the device, the sandbox. Set once by the plugin.

The secret seed is read once, from a file (GRADER_SECRET_SEED_FILE) or a variable (GRADER_SECRET_SEED), and both
variables are then removed from the grader's environment: no process started afterwards inherits them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from grader.sandbox.isolation import Isolation
from grader.session.packages import PackageSpec

SECRET_SEED_VARIABLE = "GRADER_SECRET_SEED"
SECRET_SEED_FILE_VARIABLE = "GRADER_SECRET_SEED_FILE"


@dataclass(frozen=True)
class Context:
    profile: str
    impl: PackageSpec  # as given: what the student knows it as
    reference: PackageSpec
    device: torch.device
    isolation: Isolation
    isolation_note: str = ""
    impl_copy: PackageSpec | None = None  # the private copy that sandboxes see

    @property
    def graded(self) -> PackageSpec:
        return self.impl_copy or self.impl


_current: Context | None = None
_secret_seed: int | None = None


def set_current(context: Context) -> None:
    global _current
    _current = context


def current() -> Context:
    if _current is None:
        raise RuntimeError("the grader's context is set by its pytest plugin: run `pytest grader`")
    return _current


def take_secret_seed() -> None:
    """Read the seed and remove it from the environment; raises if neither the file nor the variable gives one."""
    global _secret_seed
    path = os.environ.pop(SECRET_SEED_FILE_VARIABLE, "")
    value = os.environ.pop(SECRET_SEED_VARIABLE, "")
    if path.strip():
        value = Path(path).read_text()
    if not value.strip():
        raise RuntimeError(
            f"the grading profile draws secret inputs: set {SECRET_SEED_FILE_VARIABLE} to a file holding an integer "
            f"(or {SECRET_SEED_VARIABLE} to one)"
        )
    _secret_seed = int(value.strip())


def secret_seed() -> int:
    if _secret_seed is None:
        raise RuntimeError("the secret seed is read when the grading profile starts")
    return _secret_seed
