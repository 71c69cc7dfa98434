"""Gradescope: `python -m grader gradescope OUT.zip` builds an autograder, and Gradescope runs its run_autograder.

Gradescope unpacks the zip into /autograder/source and runs its setup.sh once, when it builds the image. For each
submission it puts the student's upload in /autograder/submission, runs /autograder/run_autograder (which calls
`run` below) and shows /autograder/results/results.json. The zip holds the reference (students see results only)
and, for the grading profile, a secret seed drawn when the zip is built. Gradescope's machines have no GPU: it grades
what a CPU can (no speed tests, no tests that need GPUs); the course's cluster grades the rest.

A grading run here is the cluster's grading job (grader.cluster.grading_job): the upload is laid over a copy of the
stubs, graded in the sandbox with the reference out of its reach, and its results are trusted only when signed by
this run's grader. Anything else (no implementation in the upload, a grader that did not finish) becomes a
results file with zero points and the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import stat
import sys
import zipfile
from pathlib import Path

from assignment.registry import PROBLEMS, problem_ids
from grader.cluster.grading_job import GradingRequest, run_grading
from grader.cluster.jobs import GRADED_EXIT_STATUSES
from grader.sandbox import submission
from grader.sandbox.policy import SECRET_SEED_FILE_VARIABLE
from grader.session import seal

REPOSITORY = Path(__file__).resolve().parents[2]
# What the zip carries of this repository: the grader, the registry, the reference and the stubs (a module the
# upload lacks is graded from its stub: "not implemented").
SOURCE_PARTS = ("assignment", "grader", "reference", "student_impl", "pyproject.toml", "README.md")
CONFIG = "gradescope.json"
SEED_FILE = "secret_seed"
ROOT_VARIABLE = "AUTOGRADER_ROOT"  # stands in for /autograder (tests)
FAMILIES = sorted({problem.family for problem in PROBLEMS})

SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (choose the Ubuntu 24.04 base image).
set -euo pipefail
apt-get update
DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv bubblewrap
python3 -m venv /autograder/venv
# The CPU build of torch: Gradescope's machines have no GPU, and an unpinned torch pulls a CUDA build of several GB.
/autograder/venv/bin/pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
/autograder/venv/bin/pip install -e /autograder/source
"""

RUN_AUTOGRADER = f"""#!/usr/bin/env bash
# Gradescope's entry point for each submission ({ROOT_VARIABLE} stands in for /autograder when testing).
set -euo pipefail
root="${{{ROOT_VARIABLE}:-/autograder}}"
python="$root/venv/bin/python"
[ -x "$python" ] || python=python3
cd "$root/source"
exec "$python" -m grader.release.gradescope "$root"
"""


# --- building the zip ----------------------------------------------------------------------------------------------


def build(out: Path, profile: str = "grading", problems: list[str] | None = None) -> Path:
    """Write the autograder zip to `out`: the source parts, setup.sh, run_autograder, and the grading settings."""
    config = {"profile": profile, "problems": problems or []}
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for part in SOURCE_PARTS:
            path = REPOSITORY / part
            files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
            for file in files:
                relative = file.relative_to(REPOSITORY)
                if submission.copied(relative) and not any(piece.endswith(".egg-info") for piece in relative.parts):
                    archive.write(file, str(relative))
        executable(archive, "setup.sh", SETUP_SH)
        executable(archive, "run_autograder", RUN_AUTOGRADER)
        archive.writestr(CONFIG, json.dumps(config, indent=1) + "\n")
        if profile == "grading":
            archive.writestr(SEED_FILE, f"{secrets.randbelow(2**31)}\n")
    return out


def executable(archive: zipfile.ZipFile, name: str, text: str) -> None:
    info = zipfile.ZipInfo(name)
    info.external_attr = (stat.S_IFREG | 0o755) << 16
    archive.writestr(info, text)


# --- grading one submission ---------------------------------------------------------------------------------------


def implementation_in(upload: Path) -> Path | None:
    """The implementation package in an upload: its student_impl/ (at the top or one folder down, as in a zipped
    repository), or the upload itself when it holds family folders (kernels/, attention/, moe/, parallel/). No link
    is followed: one where the package would be is taken as the package, for the check to refuse by name."""
    folders = sorted(path for path in upload.iterdir() if path.is_dir() and not path.is_symlink())
    for candidate in (upload / "student_impl", *(folder / "student_impl" for folder in folders)):
        if folder_or_link(candidate):
            return candidate
    if any(folder_or_link(upload / family) for family in FAMILIES):
        return upload
    return None


def folder_or_link(path: Path) -> bool:
    return path.is_symlink() or path.is_dir()


def failure_results(why: str) -> dict:
    return {"score": 0.0, "execution_time": 0, "output": f"Not graded: {why}", "tests": []}


def hide_from_others(path: Path) -> None:
    """Owner-only permissions: where no bwrap sandbox can be had, student code runs as another user (grader's uid
    isolation), which must not read the reference or the seed."""
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        item.chmod(item.stat().st_mode & ~0o077)


def grade(root: Path) -> dict:
    source, work = root / "source", root / "work"
    config = json.loads((source / CONFIG).read_text())
    impl = implementation_in(root / "submission")
    if impl is None:
        families = ", ".join(f"{family}/" for family in FAMILIES)
        return failure_results(f"no implementation in the upload: upload your student_impl/ folder (or its "
                               f"{families} folders)")
    try:
        upload = submission.read(impl)
    except submission.BadSubmission as error:
        return failure_results(str(error))
    shutil.rmtree(work, ignore_errors=True)
    package = work / "impl"
    shutil.copytree(source / "student_impl", package, ignore=submission.IGNORED)
    upload.write_to(package)
    hide_from_others(source / "reference")
    environment = {}
    if (source / SEED_FILE).exists():
        hide_from_others(source / SEED_FILE)
        environment[SECRET_SEED_FILE_VARIABLE] = str(source / SEED_FILE)
    lanes = max(1, min(4, os.cpu_count() or 1))
    selection = ("--problem", ",".join(config["problems"])) if config["problems"] else ()
    request = GradingRequest.in_folder(work, package, reference=str(source / "reference"), profile=config["profile"],
                                       pytest_args=(*selection, "--jobs", str(lanes)), environment=environment)
    status = run_grading(request)
    results_path = Path(request.results_json)
    if status not in GRADED_EXIT_STATUSES or not results_path.exists():
        return failure_results(f"the grader stopped with exit status {status}; ask the course staff")
    results = json.loads(results_path.read_text())
    why = seal.verify(results, request.key(), request.nonce)
    return results if why is None else failure_results(f"the results failed verification ({why})")


def run(root: Path) -> int:
    results = grade(root)
    (root / "results").mkdir(parents=True, exist_ok=True)
    (root / "results" / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


def add_command(commands) -> None:
    parser = commands.add_parser("gradescope", help="build a Gradescope autograder zip (CPU points)")
    parser.add_argument("out", type=Path, help="the zip to write, e.g. autograder.zip")
    parser.add_argument("--profile", default="grading", choices=("grading", "public", "ci"),
                        help="grading (the default) draws secret inputs from a seed stored in the zip")
    parser.add_argument("--problems", help="comma-separated problem ids to grade (default: all)")


def build_command(args: argparse.Namespace) -> int:
    problems = problem_ids(args.problems or "") or None
    print(f"wrote {build(args.out, args.profile, problems)}")
    return 0


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get(ROOT_VARIABLE, "/autograder"))))
