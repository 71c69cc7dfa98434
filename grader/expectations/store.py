"""The stored expectations of one profile: one xz-compressed torch.save archive per problem, read back with
weights_only=True, and the running test's records."""

from __future__ import annotations

import io
import lzma
from pathlib import Path

import torch

from grader.expectations import misses
from grader.expectations.calls import record_call, replay_call
from grader.expectations.digests import canonical_draws, digest, versions
from grader.expectations.misses import DrawsDiffer, miss

FORMAT = 1
SUFFIX = ".pt.xz"

_test: dict | None = None  # the running test's records (replay) or the records being made (record)


class Store:
    """Expectations of one profile, one file per problem, recorded (mode "record") or served (mode "replay")."""

    def __init__(self, folder: Path, mode: str, profile: str):
        self.folder, self.mode, self.profile = Path(folder), mode, profile
        self.problems: dict[str, dict] = {}

    def file(self, problem_id: str) -> Path:
        return self.folder / f"{problem_id}{SUFFIX}"

    def problem(self, problem_id: str) -> dict:
        if problem_id not in self.problems:
            if self.mode == "record":
                self.problems[problem_id] = {"format": FORMAT, "problem": problem_id, "profile": self.profile,
                                             "versions": versions(), "draws": canonical_draws(), "tests": {}}
            else:
                self.problems[problem_id] = self.load(problem_id)
        return self.problems[problem_id]

    def load(self, problem_id: str) -> dict:
        path = self.file(problem_id)
        if not path.exists():
            raise DrawsDiffer(f"the stored expectations in {self.folder} hold none for {problem_id} (a students' "
                              "copy released without this problem): it is graded on submission")
        data = read(path)
        if data.get("format") != FORMAT or data.get("profile") != self.profile:
            raise DrawsDiffer(f"{path} holds format {data.get('format')}, profile {data.get('profile')!r}; this "
                              f"grader reads format {FORMAT}, profile {self.profile!r}")
        return data

    def begin_test(self, problem_id: str, nodeid: str) -> None:
        global _test
        tests = self.problem(problem_id)["tests"]
        _test = tests.setdefault(nodeid, {}) if self.mode == "record" else tests.get(nodeid, {})
        misses.reset()

    def write(self, problem_ids) -> list[Path]:
        self.folder.mkdir(parents=True, exist_ok=True)
        written = []
        for problem_id in problem_ids:
            if problem_id in self.problems:
                buffer = io.BytesIO()
                torch.save(self.problems[problem_id], buffer)
                self.file(problem_id).write_bytes(lzma.compress(buffer.getvalue()))
                written.append(self.file(problem_id))
        return written


def check_draws(folder: Path) -> None:
    """Raise DrawsDiffer, naming the versions, when this machine would draw other inputs than the recording (every
    problem's file holds the same canonical draw: the first one read stands for all)."""
    first = next(iter(sorted(Path(folder).glob(f"*{SUFFIX}"))), None)
    if first is None:
        return
    data = read(first)
    if data.get("draws") != canonical_draws():
        recorded, here = data.get("versions", {}), versions()
        raise DrawsDiffer(
            f"the stored expectations were recorded with torch {recorded.get('torch')} and hypothesis "
            f"{recorded.get('hypothesis')}; this machine has torch {here['torch']} and hypothesis "
            f"{here['hypothesis']}, which draw other inputs. Install the recorded versions "
            f"(pip install torch=={recorded.get('torch')} hypothesis=={recorded.get('hypothesis')}) and run again"
        )


def read(path: Path) -> dict:
    """One problem's records: an xz-compressed torch.save archive, loaded with weights_only=True (no code runs)."""
    return torch.load(io.BytesIO(lzma.decompress(Path(path).read_bytes())), weights_only=True)


def call_key(name: str, args: tuple, kwargs: dict) -> str:
    return f"{name}:{digest((args, kwargs))}"


def record(name: str, function, args: tuple, kwargs: dict):
    """Record mode: call the reference and keep the record under the running test."""
    key = call_key(name, args, kwargs)  # before the call, which may change its arguments
    test = _test if _test is not None else {}
    value, entry = record_call(function, args, kwargs, test.setdefault(key, {}))
    return value, entry["seconds"]


def replay(name: str, args: tuple, kwargs: dict, device: torch.device):
    """Replay mode: the recorded value of this call, and the seconds the reference took for it."""
    entry = (_test or {}).get(call_key(name, args, kwargs))
    if entry is None:
        miss(f"{name}() on these inputs")
    return replay_call(entry, args, kwargs, device), entry["seconds"]
