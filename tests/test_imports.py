"""The import graph of grader/ and assignment/: no circle, and no arrow running back up the layers.

The layers are benchmarks -> grader -> reference and grader -> assignment (the grader reads the registry): assignment
imports no grader module, and neither package imports reference, tests or benchmarks with an import statement (the
grader reaches the reference by path, through importlib, never as a module it is built on). Every .py file is read
with `ast`, never imported, so the test is fast and needs no torch; imports inside functions count too, since a lazy
import is how a circle hides.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("grader", "assignment")
# Top-level packages that grader/ and assignment/ must not import: the reference is only loaded by path, and the
# tests and benchmarks sit above the grader.
FORBIDDEN = ("reference", "tests", "benchmarks")
# Imports of assignment/ into grader/ that stay for now, each with why: (importing module, imported module) -> reason.
ALLOWED_ARROWS_UP = {
    ("assignment.handout.build", "grader.sandbox.source_policy"):
        "the handout prints the source policy's rules; the module imports nothing but the standard library",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def imported(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in the file, at any depth; `from a import b` gives a.b, which is a module
    when b is one (the caller checks), else an attribute of a."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # `from .x import y` is relative to the module's package, one level up per extra dot.
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            source = ".".join(part for part in (base, node.module) if part)
            found += [(node.lineno, f"{source}.{alias.name}") for alias in node.names]
    return found


def resolve(name: str, modules: dict[str, Path]) -> str:
    """The longest prefix of `name` that is a module of ours (`grader.x.CONSTANT` -> grader.x), else `name`. Only the
    module named is an arrow: the packages above it are already being imported when it runs, so an arrow to them
    would show circles that Python does not have."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return name


@functools.cache  # parsed once for the three tests
def graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}, over every module of grader/ and
    assignment/, with the imports of anything else (the standard library, torch, reference...) kept as named."""
    modules = sources()
    arrows: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        arrows[module] = {}
        for line, name in imported(module, path):
            arrows[module].setdefault(resolve(name, modules), line)
    return arrows


def cycles(arrows: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest circle through each strongly connected set of modules (Tarjan), as a -> b -> a."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(module: str) -> None:  # recursion depth is the longest import chain: a few dozen at most
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in arrows[module]:
            if target not in arrows:
                continue
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1 or module in arrows[module]:
                components.append(sorted(component))

    for module in sorted(arrows):
        if module not in index:
            visit(module)

    return [shortest_circle(component[0], set(component), arrows) for component in components]


def shortest_circle(start: str, members: set[str], arrows: dict[str, dict[str, int]]) -> list[str]:
    """Breadth first from `start`, through `members` only, back to `start`."""
    paths = {start: [start]}
    queue = [start]
    for module in queue:  # the queue grows while it is read: breadth first
        for target in sorted(arrows[module]):
            if target == start:
                return paths[module] + [start]
            if target in members and target not in paths:
                paths[target] = paths[module] + [target]
                queue.append(target)
    raise AssertionError(f"{start} is in no circle of {sorted(members)}")


def test_no_import_cycle():
    arrows = graph()
    found = cycles(arrows)
    chains = [" -> ".join(f"{a} (line {arrows[a][b]})" for a, b in zip(c, c[1:])) + f" -> {c[-1]}" for c in found]
    assert not found, "import circles:\n" + "\n".join(chains)


def test_no_arrow_back_up():
    wrong = []
    for module, targets in graph().items():
        for target, line in targets.items():
            up = module.split(".")[0] == "assignment" and target.split(".")[0] == "grader"
            if (up and (module, target) not in ALLOWED_ARROWS_UP) or target.split(".")[0] in FORBIDDEN:
                wrong.append(f"{module} (line {line}) imports {target}")
    assert not wrong, "imports against the layers (benchmarks -> grader -> reference, grader -> assignment):\n" + (
        "\n".join(wrong))


def test_allowed_arrows_still_exist():
    """An exception that nothing uses any more is removed, so that the list says what is true."""
    arrows = graph()
    assert [pair for pair in ALLOWED_ARROWS_UP if pair[1] not in arrows.get(pair[0], {})] == []
