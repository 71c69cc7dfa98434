"""A new problem's places written as skeletons, and a problem's places removed again.

    python -m assignment new-problem <family>.<name> [--root DIR]
    python -m assignment remove-problem <family>.<name> [--root DIR]

new-problem writes what the project's tests require of every problem (README, "Adding a problem"): the registry
entry (before its family's analysis questions, so the teaching order keeps them last), the stub, a reference that
raises, a grader module with one test, the handout section, and the problem's lane seconds (estimates, listed under
"estimated" in the lanes file until measured). Every text a person must write holds UNFILLED, and
tests/test_registry.py's test_no_place_is_left_unfilled names each place that still does. The reference raising
makes tests/test_self_check.py fail too, and the handout is stale until rebuilt: a skeleton never passes as done.
A problem with speed tests also needs its family's SPEEDS and its measured ratios (README); the skeleton has none.

remove-problem undoes new-problem exactly: the files it wrote, the registry entry, the lane seconds.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

# The word every place a person must still write holds.
UNFILLED = "UNFILLED"
FAMILIES = ("kernels", "attention", "moe", "parallel")
LANES_FILE = Path("grader") / "session" / "lane_seconds.json"
REGISTRY_FILE = Path("assignment") / "registry.py"
ESTIMATED_SECONDS = 60.0


def files_of(family: str, name: str) -> dict[Path, str]:
    """Each file of the problem, relative to the root, and its skeleton."""
    problem_id = f"{family}.{name}"
    return {
        Path("student_impl") / family / f"{name}.py": STUB.format(problem_id=problem_id, name=name, mark=UNFILLED),
        Path("reference") / family / f"{name}.py": REFERENCE.format(problem_id=problem_id, name=name, mark=UNFILLED),
        Path("grader") / family / f"test_{name}.py": GRADER.format(problem_id=problem_id, name=name, mark=UNFILLED),
        Path("assignment") / "handout" / "sections" / family / f"{name}.typ": SECTION.format(mark=UNFILLED),
    }


STUB = '''"""{problem_id}: {mark} (what the student builds, in one paragraph)."""

import torch


def {name}(x: torch.Tensor) -> torch.Tensor:
    """{mark}: the contract.

    Args:
        x: {mark} (shape, dtypes, strides, device).

    Returns:
        {mark} (shape, dtype, whether a new tensor).

    Raises:
        {mark} (each invalid argument and its error).
    """
    raise NotImplementedError
'''

REFERENCE = '''"""{problem_id}: the reference solution. {mark}"""

import torch


def {name}(x: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError("{mark}: the reference of {problem_id}")
'''

GRADER = '''"""Grading {problem_id}: {mark} (what each test checks, and why that catches a wrong implementation)."""

from __future__ import annotations

import torch

from assignment.registry import BY_ID
from grader.checks.compare import assert_equal
from grader.session.context import current

PROBLEM = BY_ID["{problem_id}"]


def test_example(student, reference):
    """{mark}: one worked example of the contract (add a test function per points group)."""
    x = torch.arange(6.0, device=current().device).reshape(2, 3)
    reply, expected = student.call_beside(lambda: reference.{name}(x), "{name}", x)
    assert_equal(reply["value"], expected, what="{name}(x)", context="x = arange(6).reshape(2, 3)")
'''

SECTION = """#import "/self_check.typ": self-check

{mark}: what the problem teaches, derived from its definition; a figure; a worked example.

#self-check([+ {mark}: a question to answer before coding.], [(1) {mark}: its answer.])
"""

ENTRY = '''    Problem(
        id="{problem_id}",
        title="{mark}: title",
        hours=1,
        learns="{mark}: what the student learns",
        points={{"example": 1}},{evidence}
    ),
'''


def entry_text(family: str, name: str) -> str:
    # The parallel family's tests each say what their points rest on (tests/test_registry.py).
    evidence = f'\n        evidence={{"example": "{UNFILLED}: outside or in-process, and what"}},' \
        if family == "parallel" else ""
    return ENTRY.format(problem_id=f"{family}.{name}", mark=UNFILLED, evidence=evidence)


def insert_entry(registry: str, family: str, name: str) -> str:
    """The registry with the new entry before its family's analysis questions (or after its family's last problem)."""
    entry = entry_text(family, name)
    analysis = registry.find(f'        id="{family}.analysis",')
    if analysis >= 0:
        at = registry.rindex("    Problem(\n", 0, analysis)
    else:
        ids = [m.end() for m in re.finditer(rf'        id="{family}\.\w+",\n', registry)]
        if not ids:
            raise SystemExit(f"the registry has no problem of family {family} to place the new one after")
        at = registry.index("    ),\n", ids[-1]) + len("    ),\n")
    return registry[:at] + entry + registry[at:]


def new_problem(root: Path, problem_id: str) -> list[Path]:
    family, name = parse(problem_id)
    files = files_of(family, name)
    existing = [path for path in files if (root / path).exists()]
    registry_path = root / REGISTRY_FILE
    registry = registry_path.read_text()
    if existing or f'id="{problem_id}"' in registry:
        raise SystemExit(f"{problem_id} exists already: {', '.join(map(str, existing)) or 'in the registry'}")
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    registry_path.write_text(insert_entry(registry, family, name))
    lanes = json.loads((root / LANES_FILE).read_text())
    for key, seconds in lanes.items():
        if key != "estimated":
            seconds[problem_id] = ESTIMATED_SECONDS
    lanes["estimated"] = sorted({*lanes.get("estimated", []), problem_id})
    write_lanes(root, lanes)
    return [*files, REGISTRY_FILE, LANES_FILE]


def remove_problem(root: Path, problem_id: str) -> None:
    family, name = parse(problem_id)
    for path in files_of(family, name):
        (root / path).unlink(missing_ok=True)
    registry_path = root / REGISTRY_FILE
    registry = registry_path.read_text()
    start = registry.find(f'    Problem(\n        id="{problem_id}",\n')
    if start >= 0:
        end = registry.index("\n    ),\n", start) + len("\n    ),\n")
        registry_path.write_text(registry[:start] + registry[end:])
    lanes = json.loads((root / LANES_FILE).read_text())
    for key, seconds in lanes.items():
        if key != "estimated":
            seconds.pop(problem_id, None)
    estimated = [other for other in lanes.pop("estimated", []) if other != problem_id]
    if estimated:
        lanes["estimated"] = estimated
    write_lanes(root, lanes)


def write_lanes(root: Path, lanes: dict) -> None:
    """As the file is kept: one space an indent, each key's problems sorted."""
    tidy = {key: dict(sorted(value.items())) if isinstance(value, dict) else value for key, value in lanes.items()}
    (root / LANES_FILE).write_text(json.dumps(tidy, indent=1) + "\n")


def parse(problem_id: str) -> tuple[str, str]:
    family, _, name = problem_id.partition(".")
    if family not in FAMILIES or not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name == "analysis":
        raise SystemExit(f"a problem id is <family>.<name>, the family one of {', '.join(FAMILIES)} and the name "
                         f"lower_snake_case (not analysis); got {problem_id!r}")
    return family, name


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m assignment", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("new-problem", "remove-problem"))
    parser.add_argument("problem", help="<family>.<name>, e.g. kernels.layernorm")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args(argv)
    if args.command == "new-problem":
        written = new_problem(args.root, args.problem)
        print(f"wrote {args.problem}'s places (each holds {UNFILLED} where you must write):")
        for path in written:
            print(f"  {path}")
        print("then: pytest tests -k unfilled names what is left; README.md, \"Adding a problem\", says the order")
    else:
        remove_problem(args.root, args.problem)
        print(f"removed {args.problem}'s places")


if __name__ == "__main__":
    main(sys.argv[1:])
