"""Build `handout.pdf` from the typst sources, the problem registry and the stubs' contracts.

    python -m assignment.handout.build            # compile handout.pdf at the repository root
    python -m assignment.handout.build --check    # exit 1 if handout.pdf is stale; writes nothing

Everything the template shows about a problem comes from the registry (points, budgets, limits, hours, what it
teaches) and from the stub module in `student_impl/`, read with `ast` so that no student-facing code is imported. The
data reaches typst as one JSON string in `sys.inputs.data`. A stub whose docstring or signature has a line wider than
the handout prints without wrapping (CONTRACT_WIDTH) stops the build, which names the file and line.

Freshness is a SHA-256 over every file that feeds the PDF, embedded in the PDF's keywords as `source-sha256:<hex>`.
A hash and not modification times, because git does not keep mtimes: a fresh clone must still pass `--check`.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import io
import json
import re
import sys
import time
import tokenize
from pathlib import Path
from types import ModuleType

from assignment.sheet_syntax import sheet_assignment
from grader.sandbox import source_policy

HANDOUT_DIR = Path("assignment") / "handout"
TEMPLATE = HANDOUT_DIR / "handout.typ"
REGISTRY = Path("assignment") / "registry.py"
SHEET_SYNTAX = Path("assignment") / "sheet_syntax.py"  # which assignment of an answer sheet is printed
SOURCE_POLICY = Path("grader") / "sandbox" / "source_policy.py"  # the rules a submission's source follows
STUBS_DIR = Path("student_impl")
OUTPUT = Path("handout.pdf")
BUILD_COMMAND = "python -m assignment.handout.build"

# Chapter order and titles; a family missing here still gets a chapter, after these, titled by its name.
FAMILY_TITLES = {
    "kernels": "Triton kernels",
    "attention": "Attention",
    "moe": "Mixture of experts",
    "parallel": "Parallel training",
}
# Signatures longer than this are split one parameter per line, so the code blocks fit the page.
SIGNATURE_WIDTH = 112
# The longest contract line the handout prints without wrapping, in characters: a docstring line without the
# indentation it has in the source, or a line of a signature. The template sets each contract at a size that fits it.
CONTRACT_WIDTH = 112

HASH_PATTERN = re.compile(rb"source-sha256:([0-9a-f]{64})")


class BuildError(Exception):
    """A problem with the sources that stops the build; the message says which file and why."""


def default_root() -> Path:
    return Path(__file__).resolve().parents[2]


def load_registry(root: Path) -> ModuleType:
    """The registry module of the tree at `root`, loaded from its file so that `--root` can point at a copy."""
    path = root / REGISTRY
    if not path.is_file():
        raise BuildError(f"{REGISTRY} is missing under {root}")
    name = "_handout_registry"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # dataclasses looks the defining module up in sys.modules while it processes the class bodies.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def section_path(problem) -> Path:
    """The hand-written section of a problem, relative to the template's directory."""
    return Path("sections") / problem.family / f"{problem.name}.typ"


def stub_path(problem) -> Path:
    return STUBS_DIR / problem.module_path


# ---------------------------------------------------------------------------------------------------------------
# Freshness


def source_files(root: Path, problems) -> list[Path]:
    """Every file that feeds the PDF, relative to `root` and sorted: the handout directory (without caches and
    hidden files such as editor swap files), the registry, the stub module of every registered problem, and the
    grader's reading of an answer sheet."""
    handout_files = [
        path.relative_to(root)
        for path in (root / HANDOUT_DIR).rglob("*")
        if path.is_file()
        and not any(part == "__pycache__" or part.startswith(".") for part in path.relative_to(root).parts)
    ]
    stubs = [stub_path(problem) for problem in problems]
    for stub in stubs:
        if not (root / stub).is_file():
            raise BuildError(f"{stub} is missing: the handout shows the contract of every registered problem")
    graders_parts = [REGISTRY, SHEET_SYNTAX, SOURCE_POLICY]
    return sorted(set(handout_files + stubs + graders_parts), key=lambda path: path.as_posix())


def source_sha256(root: Path, files: list[Path]) -> str:
    """SHA-256 over each file's path and contents; the path and length framing makes a rename or a byte moved
    from one file to the next change the hash too."""
    digest = hashlib.sha256()
    for relative in files:
        content = (root / relative).read_bytes()
        digest.update(f"{relative.as_posix()}\0{len(content)}\0".encode())
        digest.update(content)
    return digest.hexdigest()


def current_source_sha256(root: Path) -> str:
    problems = load_registry(root).PROBLEMS
    return source_sha256(root, source_files(root, problems))


def embedded_sha256(pdf: bytes) -> str | None:
    """The source hash written into a built PDF (the keywords are stored as plain text), or None."""
    match = HASH_PATTERN.search(pdf)
    return match.group(1).decode() if match else None


def stale_reason(root: Path) -> str | None:
    """Why handout.pdf under `root` does not match its sources, or None when it does."""
    pdf = root / OUTPUT
    if not pdf.is_file():
        return f"{OUTPUT} is missing: run {BUILD_COMMAND}"
    if embedded_sha256(pdf.read_bytes()) != current_source_sha256(root):
        return f"{OUTPUT} is older than its source: run {BUILD_COMMAND}"
    return None


# ---------------------------------------------------------------------------------------------------------------
# Contracts, read from the stubs without importing them


def is_public(name: str) -> bool:
    """Public names have no leading underscore; dunder methods such as `__init__` are part of a class's contract."""
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def format_parameter(arg: ast.arg, default: ast.expr | None, prefix: str = "") -> str:
    text = prefix + arg.arg
    if arg.annotation is not None:
        text += ": " + ast.unparse(arg.annotation)
    if default is not None:
        text += (" = " if arg.annotation is not None else "=") + ast.unparse(default)
    return text


def format_parameters(args: ast.arguments) -> list[str]:
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = []
    for index, (arg, default) in enumerate(zip(positional, defaults)):
        params.append(format_parameter(arg, default))
        if index == len(args.posonlyargs) - 1:
            params.append("/")
    if args.vararg is not None:
        params.append(format_parameter(args.vararg, None, "*"))
    elif args.kwonlyargs:
        params.append("*")
    params += [format_parameter(arg, default) for arg, default in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg is not None:
        params.append(format_parameter(args.kwarg, None, "**"))
    return params


def function_signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    decorators = [f"@{ast.unparse(decorator)}\n" for decorator in node.decorator_list]
    keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    params = format_parameters(node.args)
    one_line = f"{keyword} {node.name}({', '.join(params)}){returns}:"
    if len(one_line) > SIGNATURE_WIDTH:
        one_line = f"{keyword} {node.name}(\n" + "".join(f"    {p},\n" for p in params) + f"){returns}:"
    return "".join(decorators) + one_line


def trailing_comments(source: str) -> dict[int, str]:
    """Comment text by line number, so that a field keeps the note its author wrote beside it."""
    return {
        token.start[0]: token.string
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }


def class_fields(node: ast.ClassDef) -> list[ast.AnnAssign]:
    return [
        statement
        for statement in node.body
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
    ]


def field_line(statement: ast.AnnAssign, comments: dict[int, str]) -> str:
    """An annotated field as the handout prints it, with the comment its author wrote beside it."""
    field = f"    {statement.target.id}: {ast.unparse(statement.annotation)}"
    if statement.value is not None:
        field += f" = {ast.unparse(statement.value)}"
    comment = comments.get(statement.end_lineno)
    return f"{field}  {comment}" if comment else field


def class_line(node: ast.ClassDef) -> str:
    bases = [ast.unparse(base) for base in node.bases] + [ast.unparse(keyword) for keyword in node.keywords]
    return f"class {node.name}({', '.join(bases)}):" if bases else f"class {node.name}:"


def class_signature(node: ast.ClassDef, comments: dict[int, str]) -> str:
    """The class line and its annotated fields (a NamedTuple's fields, in order, with their comments)."""
    decorators = [f"@{ast.unparse(decorator)}\n" for decorator in node.decorator_list]
    lines = [class_line(node)] + [field_line(statement, comments) for statement in class_fields(node)]
    return "".join(decorators) + "\n".join(lines)


def docstring(node) -> str:
    return ast.get_docstring(node, clean=True) or ""


def docstring_lines(node) -> list[tuple[int, str]]:
    """The lines of a node's docstring as the handout prints them, each with its line number in the source."""
    text = docstring(node)
    if not text:
        return []
    raw_lines = node.body[0].value.value.split("\n")
    # Cleaning drops the blank lines a docstring starts with.
    first = next(index for index, line in enumerate(raw_lines) if line.strip())
    return [(node.body[0].value.lineno + first + index, line) for index, line in enumerate(text.split("\n"))]


def printed_lines(node, comments: dict[int, str]) -> list[tuple[int, str]]:
    """The lines the handout prints for a module, function or class, each with its line number in the source."""
    lines = docstring_lines(node)
    if isinstance(node, ast.ClassDef):
        lines.append((node.lineno, class_line(node)))
        lines += [(statement.end_lineno, field_line(statement, comments)) for statement in class_fields(node)]
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines += [(node.lineno, line) for line in function_signature(node).split("\n")]
    return lines


def answer_sheet(module: ast.Module, source: str) -> tuple[int, str] | None:
    """An analysis problem's `ANSWERS = {...}` (grader.checks.answers) as the source writes it, with the comment
    above each question, and its first line number; None for a module that is not an answer sheet. The assignment
    the grader reads (assignment.sheet_syntax)."""
    node = sheet_assignment(module)
    return None if node is None else (node.lineno, ast.get_source_segment(source, node, padded=True))


def overlong_lines(module: ast.Module, comments: dict[int, str], source: str) -> list[tuple[int, int]]:
    """(source line, width) of every docstring, signature and answer-sheet line of the module wider than
    CONTRACT_WIDTH."""
    nodes = [module] + [
        node for node in ast.walk(module) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    printed = [line for node in nodes for line in printed_lines(node, comments)]
    sheet = answer_sheet(module, source)
    if sheet is not None:
        first, text = sheet
        printed += [(first + index, line) for index, line in enumerate(text.split("\n"))]
    return sorted({(number, len(line)) for number, line in printed if len(line) > CONTRACT_WIDTH})


def stub_contract(path: Path) -> dict:
    """The public functions and classes of a stub module: signatures, docstrings, and public methods."""
    source = path.read_text(encoding="utf-8")
    try:
        module = ast.parse(source, filename=str(path))
    except SyntaxError as error:
        raise BuildError(f"{path} does not parse: {error}") from error
    comments = trailing_comments(source)
    overlong = overlong_lines(module, comments, source)
    if overlong:
        lines = "".join(f"\n  {path}:{number}: {width} characters" for number, width in overlong)
        raise BuildError(f"contract lines wider than the {CONTRACT_WIDTH} characters the handout prints without "
                         f"wrapping (a docstring line counts without its indentation in the source):{lines}")
    items = []
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_public(node.name):
            items.append({
                "name": node.name,
                "kind": "function",
                "signature": function_signature(node),
                "doc": docstring(node),
                "methods": [],
            })
        elif isinstance(node, ast.ClassDef) and is_public(node.name):
            methods = [
                {
                    "name": f"{node.name}.{method.name}",
                    "kind": "method",
                    "signature": function_signature(method),
                    "doc": docstring(method),
                }
                for method in node.body
                if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_public(method.name)
            ]
            signature = class_signature(node, comments)
            items.append(
                {"name": node.name, "kind": "class", "signature": signature, "doc": docstring(node), "methods": methods}
            )
    sheet = answer_sheet(module, source)
    if sheet is not None:
        items.append({"name": "ANSWERS", "kind": "answers", "signature": sheet[1], "doc": "", "methods": []})
    return {"module_doc": docstring(module), "items": items}


def deliverables(contract: dict) -> list[str]:
    """The functions and methods a student writes, in the stub's order: all but those whose docstring starts with
    "Given" (code the stub gives, such as constructors that pin parameter names)."""
    entries = [entry for item in contract["items"] for entry in [item, *item["methods"]]]
    return [entry["name"] for entry in entries if entry["kind"] != "class" and not entry["doc"].startswith("Given")]


# ---------------------------------------------------------------------------------------------------------------
# Template data


def problem_data(root: Path, problem) -> dict:
    section = section_path(problem)
    if not (root / HANDOUT_DIR / section).is_file():
        raise BuildError(f"handout section {(HANDOUT_DIR / section).as_posix()} of problem {problem.id} is missing")
    if problem.hours is None or not problem.learns:
        raise BuildError(f"problem {problem.id} needs `hours` and `learns` in {REGISTRY.as_posix()}: the handout "
                         "opens the problem with both")
    contract = stub_contract(root / stub_path(problem))
    speed = None
    if problem.speed is not None:
        speed_points = problem.points.get("speed", 0)
        speed = {
            "shapes": [list(shape) for shape in problem.speed.shapes],
            "tiers": [
                {"max_ratio": ratio, "fraction": fraction, "points": speed_points * fraction}
                for ratio, fraction in problem.speed.tiers
            ],
        }
    return {
        "id": problem.id,
        "title": problem.title,
        "family": problem.family,
        "name": problem.name,
        "section": section.as_posix(),
        "stub": stub_path(problem).as_posix(),
        "test_module": problem.test_module,
        "points": [
            {"group": group, "points": points, "evidence": problem.evidence.get(group, "")}
            for group, points in problem.points.items()
        ],
        "has_evidence": bool(problem.evidence),
        "total_points": problem.max_points,
        "budgets": problem.budgets,
        "call_timeout_s": problem.call_timeout_s,
        "test_timeout_s": problem.test_timeout_s,
        "speed": speed,
        "world_sizes": list(problem.world_sizes),
        "error_multiple": problem.error_multiple,
        "floor_ulps": problem.floor_ulps,
        "hours": problem.hours,
        "learns": problem.learns,
        # The ids of the earlier problems this one builds on: the arrows of the handout's map (figures_map.typ).
        "builds_on": list(problem.builds_on),
        "contract": contract,
        "deliverables": deliverables(contract),
        # An analysis problem: the student answers the questions of an answer sheet rather than writing code.
        "answer_sheet": any(item["kind"] == "answers" for item in contract["items"]),
    }


def family_order(families: set[str]) -> list[str]:
    known = [family for family in FAMILY_TITLES if family in families]
    return known + sorted(families - set(FAMILY_TITLES))


def template_data(root: Path, registry: ModuleType, source_hash: str) -> dict:
    problems = registry.PROBLEMS
    families = [
        {
            "name": family,
            "title": FAMILY_TITLES.get(family, family.capitalize()),
            "problems": [problem_data(root, problem) for problem in problems if problem.family == family],
        }
        for family in family_order({problem.family for problem in problems})
    ]
    return {
        "source_sha256": source_hash,
        "profiles": list(registry.PROFILES),
        "reference_time_multiple": registry.REFERENCE_TIME_MULTIPLE,
        "total_points": sum(problem.max_points for problem in problems),
        "families": families,
        "source_policy": {
            "imports": [{"family": family["name"], "modules": list(source_policy.FAMILY_IMPORTS[family["name"]])}
                        for family in families],
            "rules": source_policy.rules_text(),
        },
    }


# ---------------------------------------------------------------------------------------------------------------
# Build


def compile_pdf(root: Path, data: dict) -> bytes:
    import typst

    handout_dir = root / HANDOUT_DIR
    try:
        # The typst root is the handout directory: every file typst may read lies inside the hashed sources.
        # System fonts are ignored so the output depends only on typst's embedded fonts, on any machine.
        pdf, warnings = typst.compile_with_warnings(
            str(root / TEMPLATE),
            root=str(handout_dir),
            sys_inputs={"data": json.dumps(data)},
            ignore_system_fonts=True,
        )
    except typst.TypstError as error:
        raise BuildError(f"typst could not compile {TEMPLATE}:\n{error}") from error
    for warning in warnings:
        print(f"typst warning: {warning}", file=sys.stderr)
    return pdf


def build(root: Path) -> Path:
    """Compile handout.pdf under `root`; it is written only once the compile has succeeded."""
    registry = load_registry(root)
    source_hash = source_sha256(root, source_files(root, registry.PROBLEMS))
    pdf = compile_pdf(root, template_data(root, registry, source_hash))
    if embedded_sha256(pdf) != source_hash:
        raise BuildError(f"the compiled PDF does not carry its source hash as plain text; {BUILD_COMMAND} needs it")
    output = root / OUTPUT
    output.write_bytes(pdf)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=BUILD_COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if handout.pdf is stale; write nothing")
    parser.add_argument("--root", type=Path, default=default_root(), help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        if args.check:
            reason = stale_reason(root)
            if reason is not None:
                print(reason, file=sys.stderr)
                return 1
            print(f"{OUTPUT} is up to date")
            return 0
        started = time.perf_counter()
        output = build(root)
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {output} ({output.stat().st_size // 1024} KiB) in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
