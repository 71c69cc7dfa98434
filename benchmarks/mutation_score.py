"""How many small bugs the grader catches: mutants of each reference module, each graded on its own problem.

    python benchmarks/mutation_score.py [--problems kernels.gelu,moe.router] [--per-problem 20] [--jobs 2]
        [--profile ci] [--timeout 300] [--deadline SECONDS] [--skip N] [--seed 0] [--out FILE]

A mutant is the reference module with one change made by a small AST mutator (mutation_points: an arithmetic or
comparison operator swapped, a boolean operator or constant flipped, a negation dropped, an integer moved by one).
Docstrings, error messages, f-strings and the grader-only `*_torch` oracles are left alone. Each problem's mutation
points are sampled (at most --per-problem, the same ones for the same --seed), and each mutant is graded as a
student package would be: a copy of reference/ with that one module replaced, `pytest grader --problem <id>` at the
given profile, in a subprocess.

A mutant is killed when any of its problem's tests fails, crashes or times out inside the grader, survives when all
pass, and times out when the whole run exceeds --timeout. Mutants are graded round-robin over the problems (each
problem's first, then each one's second, ...), so that with --deadline (no mutant starts after it) every problem
gets its share; a later run with --skip N (N: how many mutants of each problem the earlier one graded) grades those
it did not reach. The results go to benchmarks/results/mutation_score.md: per problem the counts and score, then every
survivor's diff, for review. A survivor is either equivalent (the change cannot alter any result the contract pins:
say why in the review) or a gap that needs a check.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from assignment.registry import BY_ID, PROBLEMS
from grader.session.report import machine_description

RESULTS_MD = ROOT / "benchmarks" / "results" / "mutation_score.md"
BASELINE = "the reference as unparsed, unchanged"
SWAPPED_OPERATORS = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.And: ast.Or, ast.Or: ast.And,
}


# --- mutation points --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One mutation: the n-th node (in ast.walk order) of the module and what it becomes."""

    node_index: int
    kind: str  # "operator", "constant", "negation"

    def describe(self, tree: ast.AST) -> str:
        node = list(ast.walk(tree))[self.node_index]
        return f"{self.kind} at line {getattr(node, 'lineno', '?')}"


def _protected(tree: ast.AST) -> set[int]:
    """ids of nodes no mutation may touch: docstrings, f-strings, the arguments of raise statements, and the plain
    `*_torch` functions, which only the grader calls (on the reference, as its float64 oracle): a student's copy of
    one is never graded."""
    protected = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_torch"):
            protected |= {id(inner) for inner in ast.walk(node)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.JoinedStr, ast.Raise)):
            protected |= {id(inner) for inner in ast.walk(node)}
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                protected.add(id(first.value))
    return protected


def mutation_points(tree: ast.AST) -> list[Point]:
    protected = _protected(tree)
    points = []
    for index, node in enumerate(ast.walk(tree)):
        if id(node) in protected:
            continue
        if isinstance(node, (ast.BinOp, ast.BoolOp)) and type(node.op) in SWAPPED_OPERATORS:
            points.append(Point(index, "operator"))
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in SWAPPED_OPERATORS:
            points.append(Point(index, "operator"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, (bool, int, float)):
            points.append(Point(index, "constant"))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            points.append(Point(index, "negation"))
    return points


def mutate(source: str, point: Point) -> str:
    """The module's source (as ast.unparse writes it) with the one change `point` names."""
    tree = ast.parse(source)
    nodes = list(ast.walk(tree))
    node = nodes[point.node_index]
    if isinstance(node, (ast.BinOp, ast.BoolOp)):
        node.op = SWAPPED_OPERATORS[type(node.op)]()
    elif isinstance(node, ast.Compare):
        node.ops = [SWAPPED_OPERATORS[type(node.ops[0])]()]
    elif isinstance(node, ast.Constant):
        value = node.value
        node.value = (not value) if isinstance(value, bool) else value + 1 if isinstance(value, int) else (
            2 * value if value else 1.0)
    elif isinstance(node, ast.UnaryOp):
        replacement = node.operand
        for parent in nodes:
            for field, child in ast.iter_fields(parent):
                if child is node:
                    setattr(parent, field, replacement)
                elif isinstance(child, list) and any(item is node for item in child):
                    setattr(parent, field, [replacement if item is node else item for item in child])
    return ast.unparse(ast.fix_missing_locations(tree))


# --- grading one mutant -----------------------------------------------------------------------------------------


@dataclass
class Verdict:
    problem: str
    point: str
    status: str  # "killed", "survived", "timed out", "invalid" (no results), "not run" (past the deadline)
    diff: str
    detail: str = ""


def grade_mutant(problem_id: str, source: str, mutated: str, point: str, profile: str, timeout_s: float) -> Verdict:
    diff = "".join(difflib.unified_diff(source.splitlines(keepends=True), mutated.splitlines(keepends=True),
                                        "reference", "mutant", n=1))
    module = Path(*problem_id.split(".")).with_suffix(".py")
    with tempfile.TemporaryDirectory(prefix="mutant-") as scratch:
        package = Path(scratch) / "mutant"
        shutil.copytree(ROOT / "reference", package, ignore=shutil.ignore_patterns("__pycache__"))
        (package / module).write_text(mutated)
        results = Path(scratch) / "results.json"
        command = [sys.executable, "-m", "pytest", "grader", "-q", "-p", "no:cacheprovider", "--impl", str(package),
                   "--profile", profile, "--problem", problem_id, "--results-json", str(results), "-x"]
        try:
            subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return Verdict(problem_id, point, "timed out", diff)
        if not results.exists():
            return Verdict(problem_id, point, "invalid", diff, "the grader wrote no results")
        tests = [t for t in json.loads(results.read_text())["tests"] if "status" in t]
        failed = [t for t in tests if t["status"] != "passed"]
    if failed:
        return Verdict(problem_id, point, "killed", diff, f"{failed[0]['name']}: {failed[0]['output'][:160]}")
    return Verdict(problem_id, point, "survived", diff)


def mutants_of(problem_id: str, per_problem: int, seed: int) -> tuple[str, list[tuple[str, str]]]:
    """The reference module's source (unparsed) and up to per_problem (point, mutated source) pairs."""
    path = ROOT / "reference" / Path(*problem_id.split(".")).with_suffix(".py")
    tree = ast.parse(path.read_text())
    source = ast.unparse(tree)
    points = mutation_points(tree)
    chosen = random.Random(f"{seed}:{problem_id}").sample(points, min(per_problem, len(points)))
    mutants = []
    for point in sorted(chosen, key=lambda p: p.node_index):
        mutated = mutate(source, point)
        if mutated != source:
            mutants.append((point.describe(tree), mutated))
    return source, mutants


# --- the report ---------------------------------------------------------------------------------------------------


def describe_machine() -> str:
    machine = machine_description()
    return (f"{machine.get('gpu') or 'no GPU'}, {os.cpu_count()} CPUs, torch {machine['torch']}, triton "
            f"{machine['triton']}, python {machine['python']}")


def render(verdicts: list[Verdict], problems: list[str], args: argparse.Namespace, seconds: float) -> str:
    lines = [
        "# Mutation score of the grader",
        "",
        "Mutants of each reference module (one AST change each: an operator swapped, a constant or boolean changed, a "
        "negation dropped), each graded on its own problem by `python benchmarks/mutation_score.py`. Killed: a test "
        "of the problem failed; survived: every test passed. Every survivor is listed below with its diff, for review.",
        "",
        f"{describe_machine()}; profile {args.profile}; at most {args.per_problem} mutants a problem (seed "
        f"{args.seed}{f', the first {args.skip} left out' if args.skip else ''}); {args.jobs} at a time; "
        f"{seconds / 60:.0f} min.",
        "",
        "| problem | mutants | killed | survived | timed out | invalid | not run | killed of valid |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for problem_id in problems:
        baseline = next(v for v in verdicts if v.problem == problem_id and v.point == BASELINE)
        if baseline.status != "survived":
            note = f"the unchanged module: {baseline.status} {baseline.detail[:80]}"
            lines.append(f"| {problem_id} | {note} | | | | | | |")
            continue
        mine = [v for v in verdicts if v.problem == problem_id and v.point != BASELINE]
        count = {status: sum(v.status == status for v in mine) for status in
                 ("killed", "survived", "timed out", "invalid", "not run")}
        valid = count["killed"] + count["survived"] + count["timed out"]
        share = f"{100 * (count['killed'] + count['timed out']) / valid:.0f}%" if valid else "-"
        lines.append(f"| {problem_id} | {len(mine)} | {count['killed']} | {count['survived']} | "
                     f"{count['timed out']} | {count['invalid']} | {count['not run']} | {share} |")
    lines += ["", "## Survivors", ""]
    for verdict in verdicts:
        if verdict.status == "survived" and verdict.point != BASELINE:
            lines += [f"### {verdict.problem}: {verdict.point}", "", "```diff", verdict.diff.rstrip(), "```", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default=",".join(p.id for p in PROBLEMS))
    parser.add_argument("--per-problem", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--deadline", type=float, default=None, help="start no mutant after this many seconds")
    parser.add_argument("--skip", type=int, default=0,
                        help="leave out each problem's first N mutants (graded by an earlier run with --deadline)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS_MD)
    args = parser.parse_args()
    problems = [p for p in args.problems.split(",") if p]
    unknown = [p for p in problems if p not in BY_ID]
    if unknown:
        parser.error(f"unknown problems: {', '.join(unknown)}")
    queues = []
    for problem_id in problems:
        source, mutants = mutants_of(problem_id, args.per_problem, args.seed)
        # The unparsed module unchanged first: it must survive, or the problem's mutants say nothing.
        queues.append([(problem_id, source, source, BASELINE)] +
                      [(problem_id, source, mutated, point) for point, mutated in mutants[args.skip:]])
    work = [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]
    started = time.monotonic()

    def run(job) -> Verdict:
        problem_id, source, mutated, point = job
        if args.deadline is not None and time.monotonic() - started > args.deadline:
            return Verdict(problem_id, point, "not run", "")
        verdict = grade_mutant(problem_id, source, mutated, point, args.profile, args.timeout)
        print(f"{verdict.problem:36} {verdict.status:10} {verdict.point}", flush=True)
        return verdict

    with ThreadPoolExecutor(args.jobs) as pool:
        verdicts = list(pool.map(run, work))
    args.out.write_text(render(verdicts, problems, args, time.monotonic() - started))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
