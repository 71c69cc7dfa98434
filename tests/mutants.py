"""Deliberately wrong implementations ("mutants"), each stored as a diff against the reference.

A mutant is a folder tests/wrong/<family>/<name>/<variant>/ holding two files:

- change.diff: a unified diff that puts one bug into reference/<family>/<name>.py or, when expect.toml names a
  `based_on` mutant of the same problem, into that mutant's module (wrong implementations of one problem are mostly
  one student's code with a different bug, so each is stored against its nearest sibling: a few lines each);
- expect.toml: what grading it must show. `test` is the grader test that must fail (its node id after `::`),
  `fragments` words its message must all contain, `any_of` words one of which it must contain, `status` the status
  it must fail with ("failed" unless given), `grader_args` extra arguments its grader run needs, `xfail` why the
  grader does not catch it yet (its test then fails, strictly), and `why` one line on the bug and why that test
  catches it.

Adding a wrong implementation is adding one such folder. A mutant's module is the reference with its diff applied,
written into a temporary implementation package (`materialise`), where it may sit beside other problems' mutants.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from assignment.registry import BY_ID
from tests.grading import ROOT

WRONG = Path(__file__).resolve().parent / "wrong"
REFERENCE = ROOT / "reference"
DIFF = "change.diff"
EXPECT = "expect.toml"
EXPECT_KEYS = {"why", "test", "fragments", "any_of", "status", "grader_args", "xfail", "based_on"}
HUNK_HEADER = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass(frozen=True)
class Mutant:
    problem: str  # e.g. "moe.router"
    variant: str  # the folder's name, e.g. "z_loss_unsquared"
    why: str
    test: str  # e.g. "test_losses" or "test_matches_single_process[2]"
    fragments: tuple[str, ...] = ()
    any_of: tuple[str, ...] = ()
    status: str = "failed"
    grader_args: tuple[str, ...] = ()
    xfail: str = ""
    based_on: str = ""  # the sibling mutant its diff applies to ("": the reference)

    @property
    def id(self) -> str:
        return f"{self.problem}/{self.variant}"

    @property
    def folder(self) -> Path:
        return WRONG.joinpath(*self.problem.split(".")) / self.variant

    @property
    def module_path(self) -> Path:
        """Where its module lies in an implementation package (and the reference's in reference/)."""
        return Path(*self.problem.split(".")).with_suffix(".py")

    @property
    def node_id(self) -> str:
        return f"{BY_ID[self.problem].test_module}::{self.test}"

    def source(self, seen: tuple[str, ...] = ()) -> str:
        if self.id in seen:
            raise ValueError(f"{self.id}: its based_on chain comes back to itself ({' -> '.join(seen)})")
        if self.based_on:
            base = load(self.folder.parent / self.based_on).source((*seen, self.id))
        else:
            base = (REFERENCE / self.module_path).read_text()
        return apply_diff(base, (self.folder / DIFF).read_text(), self.id)


def load(folder: Path) -> Mutant:
    problem = f"{folder.parent.parent.name}.{folder.parent.name}"
    name = f"{problem}/{folder.name}"
    if problem not in BY_ID:
        raise ValueError(f"{name}: {folder.parent.relative_to(WRONG)} is no problem's folder (<family>/<name>)")
    expect = tomllib.loads((folder / EXPECT).read_text())
    unknown, missing = expect.keys() - EXPECT_KEYS, {"why", "test"} - expect.keys()
    if unknown or missing:
        raise ValueError(f"{name}/{EXPECT}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
    if not expect.get("fragments") and not expect.get("any_of"):
        raise ValueError(f"{name}/{EXPECT}: give the words that name the fault, in fragments or any_of")
    lists = {key: tuple(expect[key]) for key in ("fragments", "any_of", "grader_args") if key in expect}
    return Mutant(problem, folder.name, **{**expect, **lists})


def variant_folders() -> list[Path]:
    return sorted(path for path in WRONG.glob("*/*/*") if path.is_dir())


def discover() -> list[Mutant]:
    return [load(folder) for folder in variant_folders()]


def apply_diff(original: str, diff: str, name: str) -> str:
    """`original` with the unified diff applied; `name` (the mutant's id) is in every error.

    A hunk applies where its header says, shifted by what earlier hunks added or removed, or else at the nearest
    place after the previous hunk where its old lines stand (the reference may have grown elsewhere since the diff
    was made). Where they stand nowhere, its context lines are trimmed, one from each end at a time, as `patch`'s
    fuzz does: an edit of the reference next to a mutant's change, not of the changed lines themselves, leaves the
    mutant valid (`python -m tests.mutants refresh` then rewrites its diff against the reference as it is). A hunk
    whose changed lines stand nowhere is an error: the mutant must be made again.
    """
    lines = original.splitlines(keepends=True)
    result: list[str] = []
    done = 0  # lines of `original` consumed so far
    shift = 0  # how far the hunks found so far stood from their headers
    for header, old, new in hunks(diff, name):
        # Lines count from 1; a hunk that removes nothing names the line it inserts after.
        start = int(header.group(1)) - (1 if header.group(2) != "0" else 0) + shift
        for old_at, new_at in fuzzed(old, new):
            candidates = [at for at in range(done, len(lines) - len(old_at) + 1)
                          if lines[at:at + len(old_at)] == old_at]
            if candidates:
                break
        else:
            raise ValueError(f"{name}: hunk {header.group(0)} of its {DIFF} does not apply: its old lines\n"
                             f"{''.join(old)}stand nowhere after line {done} of the reference; make the diff again")
        at = min(candidates, key=lambda candidate: abs(candidate - start))
        shift += at - start
        result += lines[done:at] + new_at
        done = at + len(old_at)
    return "".join(result + lines[done:])


def fuzzed(old: list[str], new: list[str]):
    """(old, new) lines of a hunk, then with one, two, ... context lines trimmed from each end, down to none: the
    lines both sides share at an end are context (a hunk's changed lines are never trimmed, and an insertion keeps at
    least one line of context to be placed by)."""
    leading = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    trailing = next((i for i, (a, b) in enumerate(zip(reversed(old), reversed(new))) if a != b),
                    min(len(old), len(new)) - leading)
    trailing = min(trailing, min(len(old), len(new)) - leading)
    for fuzz in range(max(leading, trailing) + 1):
        head, tail = min(fuzz, leading), min(fuzz, trailing)
        if len(old) - head - tail > 0:  # an insertion keeps a line to stand on
            yield old[head:len(old) - tail], new[head:len(new) - tail]


def hunks(diff: str, name: str):
    """(header match, old lines, new lines) of each hunk of a unified diff, in order."""
    lines = diff.splitlines(keepends=True)
    at = next((i for i, line in enumerate(lines) if line.startswith("@@")), len(lines))
    if at == len(lines):
        raise ValueError(f"{name}: its {DIFF} has no hunk")
    while at < len(lines):
        header = HUNK_HEADER.match(lines[at])
        if header is None:
            raise ValueError(f"{name}: line {at + 1} of its {DIFF} is not a hunk header: {lines[at]!r}")
        old_left, new_left = int(header.group(2) or 1), int(header.group(4) or 1)
        old, new = [], []
        at += 1
        while old_left > 0 or new_left > 0:
            if at == len(lines):
                raise ValueError(f"{name}: its {DIFF} ends inside hunk {header.group(0)}")
            # An editor that strips trailing blanks leaves an empty context line as a bare newline.
            kind, text = (" ", "\n") if lines[at] == "\n" else (lines[at][0], lines[at][1:])
            if kind == " ":
                old.append(text)
                new.append(text)
                old_left, new_left = old_left - 1, new_left - 1
            elif kind == "-":
                old.append(text)
                old_left -= 1
            elif kind == "+":
                new.append(text)
                new_left -= 1
            else:
                raise ValueError(f"{name}: line {at + 1} of its {DIFF} is neither context, removed nor added")
            at += 1
        if old_left < 0 or new_left < 0:
            raise ValueError(f"{name}: hunk {header.group(0)} of its {DIFF} holds more lines than its header says")
        yield header, old, new


def materialise(mutants: list[Mutant], package: Path) -> Path:
    """Write each mutant's module into `package` at <family>/<name>.py, the layout of an implementation package.

    One package holds at most one mutant per problem; the modules of the problems it holds no mutant of are missing.
    """
    for mutant in mutants:
        path = package / mutant.module_path
        if path.exists():
            raise ValueError(f"{mutant.id}: {path} already holds another mutant of {mutant.problem}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(mutant.source())
    return package


def rounds(mutants: list[Mutant]) -> list[list[Mutant]]:
    """The mutants grouped into grader runs: round k holds the k-th mutant of each problem, and mutants that need
    other grader arguments have rounds of their own."""
    runs: dict[tuple, list[Mutant]] = defaultdict(list)
    taken: dict[tuple, int] = defaultdict(int)  # mutants of each (grader arguments, problem) placed so far
    for mutant in sorted(mutants, key=lambda m: m.id):
        round_number = taken[mutant.grader_args, mutant.problem]
        taken[mutant.grader_args, mutant.problem] += 1
        runs[mutant.grader_args, round_number].append(mutant)
    return list(runs.values())


def firsts(mutants: list[Mutant]) -> list[Mutant]:
    """The first mutant of each problem under each grader arguments: the members of each arguments' first round."""
    first: dict[tuple, Mutant] = {}
    for mutant in sorted(mutants, key=lambda m: m.id):
        first.setdefault((mutant.grader_args, mutant.problem), mutant)
    return list(first.values())


def refreshed_diff(mutant: Mutant) -> str:
    """The mutant's diff made again against its base as it stands now (the reference, or its based_on sibling)."""
    base = load(mutant.folder.parent / mutant.based_on).source() if mutant.based_on else \
        (REFERENCE / mutant.module_path).read_text()
    path = mutant.module_path.as_posix()
    return "".join(difflib.unified_diff(base.splitlines(keepends=True), mutant.source().splitlines(keepends=True),
                                        f"a/{path}", f"b/{path}"))


def refresh(check: bool = False) -> list[Mutant]:
    """Rewrite every diff whose hunks no longer stand where they say (after edits of the reference beside them);
    the mutants' modules stay the same. With `check`, write nothing. The mutants whose diffs change."""
    stale = [mutant for mutant in discover() if refreshed_diff(mutant) != (mutant.folder / DIFF).read_text()]
    if not check:
        updates = {mutant.folder / DIFF: refreshed_diff(mutant) for mutant in stale}  # all made before any is written
        for path, diff in updates.items():
            path.write_text(diff)
    return stale


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.mutants", description="Rewrite the mutants' diffs against "
                                     "the reference as it stands (each mutant's module unchanged).")
    parser.add_argument("command", choices=("refresh",))
    parser.add_argument("--check", action="store_true", help="list the diffs that would change; write nothing")
    args = parser.parse_args()
    for mutant in refresh(check=args.check):
        print(f"{'stale' if args.check else 'rewrote'}: {mutant.id}")
