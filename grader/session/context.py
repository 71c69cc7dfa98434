"""What this grading run is: the profile, the packages being compared, the device, the sandbox. Set once by the plugin.

The secret seed is read once, from a file (GRADER_SECRET_SEED_FILE) or a variable (GRADER_SECRET_SEED), and both
variables are then removed from the grader's environment: no process started afterwards inherits them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from grader.checks import profiles
from grader.sandbox.isolation import Isolation
from grader.sandbox.policy import SECRET_SEED_FILE_VARIABLE, SECRET_SEED_VARIABLE
from grader.session.packages import PackageSpec


@dataclass(frozen=True)
class Context:
    impl: PackageSpec  # as given: what the student knows it as
    reference: PackageSpec
    device: torch.device
    isolation: Isolation
    isolation_note: str = ""
    impl_copy: PackageSpec | None = None  # the private copy that sandboxes see
    world_sizes: tuple[int, ...] | None = None  # --world-sizes: every distributed problem's, for this run

    @property
    def profile(self) -> str:
        """The profile this run grades with, read where every process of it reads it (worker and ranks too)."""
        return profiles.active()

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


def world_sizes(problem) -> tuple[int, ...]:
    """The numbers of ranks a distributed problem's tests launch in this run: the registry's, or --world-sizes'.
    Test modules read them when they are collected, after the plugin set the context (a rank that imports a test
    module for its programs has no context, and no use for them)."""
    override = _current.world_sizes if _current is not None else None
    return override if override and problem.world_sizes else problem.world_sizes


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
