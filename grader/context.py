"""What this grading run is: the profile, the packages being compared, the device. Set once by the plugin."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from grader.packages import PackageSpec

SECRET_SEED_VARIABLE = "GRADER_SECRET_SEED"


@dataclass(frozen=True)
class Context:
    profile: str
    impl: PackageSpec
    reference: PackageSpec
    device: torch.device

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"


_current: Context | None = None


def set_current(context: Context) -> None:
    global _current
    _current = context


def current() -> Context:
    if _current is None:
        raise RuntimeError("the grader's context is set by its pytest plugin: run `pytest grader`")
    return _current


def secret_seed() -> int:
    value = os.environ.get(SECRET_SEED_VARIABLE, "")
    if not value.strip():
        raise RuntimeError(f"the grading profile draws secret inputs: set {SECRET_SEED_VARIABLE} to an integer")
    return int(value)
