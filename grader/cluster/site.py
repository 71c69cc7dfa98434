"""The cluster's own grading settings, for submissions from the students' copy, which holds no reference.

The instructor puts a site file on the cluster, readable by grading jobs and by no student (default
/etc/gpu-systems-grader/site.toml; GRADER_SITE_FILE names another):

    grader = "/opt/course/gpu-systems"                  # the instructor's repository: its grader grades
    reference = "/opt/course/gpu-systems/reference"     # optional; default: <grader>/reference
    profile = "grading"                                 # optional; default: grading
    secret_seed_file = "/opt/course/secret_seed"        # the grading profile's seed

A grading job whose request names no reference (`python -m grader submit` from the students' copy) reads this file
on the node it runs on: the reference's path, the profile and the seed never travel with a submission, and the
grader that grades is the instructor's, not the copy the student submitted from.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from grader.sandbox.policy import SITE_FILE_VARIABLE

DEFAULT_SITE_FILE = Path("/etc/gpu-systems-grader/site.toml")
KEYS = {"grader", "reference", "profile", "secret_seed_file"}


@dataclass(frozen=True)
class Site:
    grader: Path
    reference: Path
    profile: str
    secret_seed_file: str | None


def site_file() -> Path:
    return Path(os.environ.get(SITE_FILE_VARIABLE) or DEFAULT_SITE_FILE)


def load() -> Site:
    """The site's settings; RuntimeError, saying what is missing, where there are none."""
    path = site_file()
    try:
        settings = tomllib.loads(path.read_text())
    except OSError as error:
        raise RuntimeError(f"this cluster has no grading site file ({path}: {error.strerror}); the course staff "
                           "configure one for submissions from the students' copy") from None
    unknown = settings.keys() - KEYS
    if unknown or "grader" not in settings:
        raise RuntimeError(f"{path}: needs `grader` (the instructor's repository); unknown keys {sorted(unknown)}")
    grader = Path(settings["grader"])
    site = Site(grader, Path(settings.get("reference") or grader / "reference"), settings.get("profile", "grading"),
                settings.get("secret_seed_file"))
    if site.profile == "grading" and not site.secret_seed_file:
        raise RuntimeError(f"{path}: the grading profile needs `secret_seed_file`")
    return site
