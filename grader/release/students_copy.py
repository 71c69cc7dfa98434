"""`python -m grader release OUT`: the students' copy of this repository, with no reference code in it.

The copy holds the stubs, the grader, the registry and handout source, handout.pdf, a pyproject.toml that pins the
packages deciding the drawn inputs, a students' README, and the expectations the grader takes from the reference,
recorded here by grading the reference on the CPU (grader.expectations). Its `pytest grader` replays them: the same
verdicts, messages and points as the live grader on the public profile. Points for speed and for tests that need a
GPU or several are given on submission, where the course's cluster grades with the hidden reference.

Speed is graded in the copy too, against the baseline each speed test times, with the ratio reference / baseline stored
per GPU model in grader/speed/ratios.json (grader.speed.grading); `--measure-speed`, on a GPU, first measures this GPU
model's ratios into that file. A problem whose reference or speed test changed since its ratios were measured is left
out of the copy's ratios (with a warning): its speed line is then advisory there.

Refused (with the reason) when OUT exists and is not empty (unless --force), when handout.pdf is stale, when
`reference/` or `assignment/` has uncommitted changes (the copy must match what is committed), or when
--measure-speed finds no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from assignment.handout.build import stale_reason
from assignment.registry import PROBLEMS, problem_ids
from grader import expectations
from grader.cluster.snapshot import IGNORED
from grader.session.packages import PackageSpec
from grader.speed import ratios as speed_ratios
from grader.speed.grading import RATIOS_FILE, stored_ratios

REPOSITORY = Path(__file__).resolve().parents[2]
COPIED = ("student_impl", "grader", "assignment", "handout.pdf")
# Instructor tools that read reference/: a students' copy has nothing for them to read.
INSTRUCTOR_ONLY = ("grader/release", "grader/speed/ratios.py")
PROFILES = ("public", "ci")  # the grading profile's inputs are secret: never stored
ALL = "(every problem: the grader wrote no results)"
README_TEMPLATE = Path(__file__).with_name("students_readme.md")


def refusals(root: Path, out: Path, force: bool, require_committed: bool = True,
             measure_speed: bool = False) -> list[str]:
    found = []
    if measure_speed and not torch.cuda.is_available():
        found.append("--measure-speed measures this machine's GPU: none is visible here")
    if out.exists() and any(out.iterdir()) and not force:
        found.append(f"{out} exists and is not empty (--force replaces it)")
    stale = stale_reason(root)
    if stale:
        found.append(f"handout.pdf is stale: {stale} (python -m assignment.handout.build)")
    if require_committed:
        found.extend(uncommitted(root))
    return found


def uncommitted(root: Path) -> list[str]:
    """Why the reference or the assignment in `root` differ from what is committed, if they do."""
    changed = subprocess.run(["git", "status", "--porcelain", "--", "reference", "assignment"], cwd=root,
                             capture_output=True, text=True)
    if changed.returncode != 0:
        return [f"git status failed: {changed.stderr.strip()}"]
    if changed.stdout.strip():
        return ["uncommitted changes under reference/ or assignment/:\n" + changed.stdout.rstrip()]
    return []


def record(root: Path, folder: Path, profile: str, problems: list[str] | None, jobs: int) -> None:
    """Grade the reference on the CPU with the profile, storing what its tests take from it; it must score full
    marks. A problem that did not is recorded once more on its own, as a rank that failed to connect under load
    would not fail it twice."""
    failed = _record(root, folder, profile, problems, jobs)
    if failed:
        failed = _record(root, folder, profile, problems if ALL in failed else sorted(failed), 1)
    if failed:
        raise RuntimeError(f"recording the {profile} profile: the reference did not pass\n{failed}")
    missing = [p for p in problems or problem_ids("") if not (folder / profile / f"{p}{expectations.SUFFIX}").exists()]
    if missing:
        raise RuntimeError(f"recording the {profile} profile stored nothing for {', '.join(missing)}")


def _record(root: Path, folder: Path, profile: str, problems: list[str] | None, jobs: int) -> dict[str, str]:
    """{problem: the end of the grader's output} for each problem the reference did not pass."""
    results = folder / f"{profile}-results.json"
    command = [sys.executable, "-m", "pytest", "grader", "-q", "-p", "no:cacheprovider", "--impl", "reference",
               "--profile", profile, "--record-expectations", str(folder), "--jobs", str(jobs),
               "--results-json", str(results)]
    if problems:
        command += ["--problem", ",".join(problems)]
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the students' copy grades on the CPU
    done = subprocess.run(command, cwd=root, env=environment, capture_output=True, text=True)
    try:
        tests = json.loads(results.read_text())["tests"]
    except (OSError, ValueError, KeyError):
        return {ALL: done.stdout[-4000:] + done.stderr[-2000:]}
    finally:
        results.unlink(missing_ok=True)
    return {test["name"].split(" :: ")[0]: done.stdout[-4000:] for test in tests if test.get("status") == "failed"}


def copy_sources(root: Path, out: Path) -> None:
    for name in COPIED:
        source = root / name
        if source.is_dir():
            shutil.copytree(source, out / name, ignore=IGNORED)
        else:
            shutil.copy2(source, out / name)
    for name in INSTRUCTOR_ONLY:
        if (out / name).is_dir():
            shutil.rmtree(out / name)
        else:
            (out / name).unlink(missing_ok=True)


def copy_speed_ratios(root: Path, out: Path) -> None:
    """The stored speed ratios, less those measured with another reference or speed test than the copy's."""
    ratios = json.loads((root / RATIOS_FILE.relative_to(REPOSITORY)).read_text())
    kept, stale = speed_ratios.without_stale(ratios, PackageSpec("reference", root / "reference"))
    (out / RATIOS_FILE.relative_to(REPOSITORY)).write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
    for gpu, stale_ids in stale.items():
        print(f"warning: the {gpu}'s speed ratios of {', '.join(stale_ids)} were measured with another reference "
              "or speed test: left out of the copy, whose speed lines for them are advisory on that GPU "
              "(python -m grader release OUT --measure-speed on that GPU measures them again)", file=sys.stderr)


def pinned_pyproject(root: Path, versions: dict) -> str:
    """This repository's pyproject.toml with torch and hypothesis pinned to the recorded versions (other versions
    may draw other inputs)."""
    text = (root / "pyproject.toml").read_text()
    for package in ("torch", "hypothesis"):
        text = re.sub(rf'"{package}[<>=!~][^"]*"', f'"{package}=={versions[package]}"', text)
    return text


def folder_size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def students_readme(out: Path, versions: dict, profiles: tuple[str, ...]) -> str:
    size_mb = folder_size(out / "expectations") / 1e6
    measured = stored_ratios(out / RATIOS_FILE.relative_to(REPOSITORY))
    gpus = ", ".join(sorted(gpu for gpu, ratios in measured.items() if ratios.get("problems"))) or "no GPU model"
    return README_TEMPLATE.read_text().format(torch=versions["torch"], hypothesis=versions["hypothesis"],
                                              size=f"{size_mb:.1f} MB", profiles=", ".join(profiles), gpus=gpus)


def build(out: Path, problems: list[str] | None = None, profiles: tuple[str, ...] = PROFILES, jobs: int = 1,
          force: bool = False, root: Path = REPOSITORY, require_committed: bool = True,
          measure_speed: bool = False) -> Path:
    """The students' copy in `out`. require_committed=False is for this repository's own tests, which build a copy
    of whatever the working tree holds."""
    found = refusals(root, out, force, require_committed, measure_speed)
    if found:
        raise ValueError("refusing to build the students' copy:\n- " + "\n- ".join(found))
    if measure_speed:
        gpu = speed_ratios.measure_into(root / RATIOS_FILE.relative_to(REPOSITORY),
                                        PackageSpec("reference", root / "reference"),
                                        [problem.id for problem in PROBLEMS if problem.speed])
        print(f"measured the {gpu}'s speed ratios into grader/{RATIOS_FILE.name}: commit them", flush=True)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for profile in profiles:
        record(root, out / "expectations", profile, problems, jobs)
    return assemble(out, out / "expectations", profiles, root)


def assemble(out: Path, recorded: Path, profiles: tuple[str, ...], root: Path = REPOSITORY) -> Path:
    """The students' copy in `out` around expectations already recorded in `recorded` (one folder per profile)."""
    out.mkdir(parents=True, exist_ok=True)
    if recorded.resolve() != (out / "expectations").resolve():
        for profile in profiles:
            shutil.copytree(recorded / profile, out / "expectations" / profile)
    copy_sources(root, out)
    copy_speed_ratios(root, out)
    versions = expectations.versions()
    (out / "pyproject.toml").write_text(pinned_pyproject(root, versions))
    (out / "README.md").write_text(students_readme(out, versions, profiles))
    return out


def add_command(commands) -> None:
    parser = commands.add_parser("release", help="build the students' copy: no reference, stored expectations")
    parser.add_argument("out", type=Path, help="the folder to write (empty or absent)")
    parser.add_argument("--force", action="store_true", help="replace OUT's contents")
    parser.add_argument("--problems", help="comma-separated problem ids (default: all)")
    parser.add_argument("--profiles", default=",".join(PROFILES), help="profiles to record (public, ci)")
    parser.add_argument("--jobs", type=int, default=1, help="lanes the recording grades in (see --jobs of pytest)")
    parser.add_argument("--measure-speed", action="store_true",
                        help="first measure this GPU model's speed ratios into grader/speed/ratios.json")


def build_command(args: argparse.Namespace) -> int:
    profiles = tuple(p for p in args.profiles.split(",") if p)
    unknown = [p for p in profiles if p not in PROFILES]
    if unknown:
        raise ValueError(f"--profiles: {', '.join(unknown)} cannot be stored (choose from {', '.join(PROFILES)})")
    out = build(args.out, problem_ids(args.problems or "") or None, profiles, args.jobs, args.force,
                measure_speed=args.measure_speed)
    print(f"wrote the students' copy to {out} (expectations: {folder_size(out / 'expectations') / 1e6:.1f} MB)")
    return 0
