"""The reference's time as a ratio to each speed test's baseline, per GPU model, for the students' copy.

A students' copy has no reference to time against, but it has the baseline every speed test already times (torch's own
operator, or a plain kernel in the grader). On the instructor's GPU this module times the reference and the baseline the
way grader.speed.grading times a student (grader.speed.grading.alternate: alternating calls, fresh inputs from their own
seeds, a cold L2, medians) and keeps reference_ms / baseline_ms for every speed case. On a student's GPU of the same
model, the copy's speed test turns student_ms / baseline_ms into "x the reference" with that ratio.

Every round also checks that what the copy checks a student's timed output against (the baseline's output, or the
spec's oracle) agrees with the reference's output, with the tolerance a student gets.

    python -m grader.speed.ratios [OUT.json] [--problems kernels.gelu,...] [--calls 30]
    python -m grader.speed.ratios OUT.json --median-of PASS1.json PASS2.json PASS3.json

adds this GPU's ratios to OUT.json (by default grader/speed/ratios.json; other GPU models already in it are kept,
and this GPU's ratios of the problems not named where torch, triton, CUDA and --calls are the same),
with digests of the reference module and the speed test's functions they were measured with: `python -m grader
release` leaves out the ratios of a problem where either changed since. Problems graded by step time on several
GPUs (the parallel family) have no single-GPU baseline: their speed points are given on submission.

An autotuned kernel may choose another configuration in another process, so its ratios are measured in several
passes, each a process of its own writing a file of its own, and --median-of keeps, case by case, the pass of the
median ratio. Measuring writes OUT.json after each problem, so a run stopped part-way keeps what it finished.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import io
import json
import sys
import textwrap
import tokenize
from pathlib import Path

import torch

from assignment.registry import BY_ID, PROBLEMS
from grader.session.packages import PackageSpec, load_problem_module, resolve
from grader.speed.grading import (
    CALLS,
    RATIOS_FILE,
    SpeedSpec,
    alternate,
    case_key,
    check_sample,
    grader_runner,
    speed_spec,
)
from grader.speed.timing import Timer, sample

FORMAT = 1


def module_digests(reference: PackageSpec, spec: SpeedSpec, problem_id: str) -> dict[str, str]:
    """SHA-256 of what a problem's ratios depend on: the reference module's code, and the code of the speed test's
    functions (baseline, inputs, harness, oracle), comments and layout left out (code_text)."""
    functions = [f for f in (spec.baseline, spec.inputs, spec.harness, spec.oracle) if f is not None]
    reference_code = code_text(reference.module_file(problem_id).read_text())
    return {"reference": hashlib.sha256(reference_code.encode()).hexdigest(),
            "grader": hashlib.sha256("\n".join(map(function_text, functions)).encode()).hexdigest()}


def code_text(source: str) -> str:
    """Python source as its tokens, without comments, layout or docstrings, joined: what the digests compare. Moving,
    rewrapping, commenting or documenting code leaves it unchanged, and so does the Python version (an AST's dump is
    not the same on 3.11 and 3.12, nor are the tokens of an f-string: see python_311_tokens)."""
    layout = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    tokens = python_311_tokens(source)
    kept = []
    for index, (kind, text) in enumerate(tokens):
        before = tokens[index - 1][0] if index else tokenize.NEWLINE
        after = tokens[index + 1][0] if index + 1 < len(tokens) else tokenize.NEWLINE
        statement_alone = before in layout and after in (tokenize.NEWLINE, tokenize.ENDMARKER)
        docstring = kind == tokenize.STRING and statement_alone
        if kind not in layout and not docstring:
            kept.append(text)
    return " ".join(kept)


def python_311_tokens(source: str) -> list[tuple[int, str]]:
    """(type, text) of each token of `source`, with every f-string one STRING token of its source text, as Python
    3.11 reads it: from 3.12 on, the tokenizer splits an f-string into its parts (FSTRING_START, the text and the
    replacement fields' own tokens, FSTRING_END)."""
    fstring_start, fstring_end = getattr(tokenize, "FSTRING_START", None), getattr(tokenize, "FSTRING_END", None)
    lines = source.splitlines(keepends=True)
    tokens, depth, begin = [], 0, (0, 0)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == fstring_start:
            begin = token.start if depth == 0 else begin
            depth += 1
        elif token.type == fstring_end:
            depth -= 1
            if depth == 0:
                (first_row, first_col), (last_row, last_col) = begin, token.end
                spanned = "".join(lines[first_row - 1:last_row])
                after_end = len(lines[last_row - 1]) - last_col  # what follows the f-string on its last line
                tokens.append((tokenize.STRING, spanned[first_col:len(spanned) - after_end]))
        elif depth == 0:
            tokens.append((token.type, token.string))
    return tokens


def function_text(function) -> str:
    """code_text of a function, its own name left out (so that renaming it changes nothing); for one without Python
    source (torch.matmul), its name."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return f"{function.__module__}.{function.__qualname__}"
    return code_text(source).replace(f"def {function.__name__} (", "def (", 1)


def measure_ratio(spec: SpeedSpec, reference_function, case: tuple, calls: int = CALLS, seed: int = 0) -> dict:
    """Median milliseconds of the reference and the baseline over `calls` alternating rounds, and their ratio."""
    timer = Timer(torch.device("cuda"))
    runners = {"reference": grader_runner(timer, spec.timed(reference_function)),
               "baseline": grader_runner(timer, spec.timed(spec.baseline))}

    def check(args, outputs, sample_seed):
        check_sample(sample(outputs["reference"], sample_seed),
                     spec.expected_sample(args, outputs["baseline"], sample_seed), getattr(torch, case[1]),
                     f"the students' copy's check of {spec.function}() on {case}, against the reference")

    medians = alternate(runners, spec.inputs, case, calls, seed, after_round=check)
    return {"reference_ms": medians["reference"], "baseline_ms": medians["baseline"],
            "reference_over_baseline": medians["reference"] / medians["baseline"]}


def measure_gpu(reference: PackageSpec, problem_ids: list[str], calls: int):
    """Yields (problem id, {"digests": module_digests(...), "cases": {case key: measure_ratio(...)}}) for each problem,
    measured on this machine's first GPU."""
    for problem in PROBLEMS:
        spec = speed_spec(problem.id) if problem.id in problem_ids and problem.speed else None
        if spec is None:
            continue
        function = getattr(load_problem_module(reference, problem.id), spec.function)
        cases = {}
        for case in problem.speed.cases():
            cases[case_key(case)] = measure_ratio(spec, function, case, calls)
            print(f"{problem.id} {case}: {cases[case_key(case)]}", flush=True)
        yield problem.id, {"digests": module_digests(reference, spec, problem.id), "cases": cases}


def stale_problems(ratios: dict, reference: PackageSpec) -> dict[str, list[str]]:
    """{GPU model: problem ids whose reference or grader module changed since its ratios were measured}."""
    stale = {}
    for gpu, measured in ratios.get("gpus", {}).items():
        changed = []
        for problem_id, entry in measured.get("problems", {}).items():
            spec = speed_spec(problem_id) if problem_id in BY_ID else None
            if spec is None or entry.get("digests") != module_digests(reference, spec, problem_id):
                changed.append(problem_id)
        if changed:
            stale[gpu] = changed
    return stale


def without_stale(ratios: dict, reference: PackageSpec) -> tuple[dict, dict[str, list[str]]]:
    """The ratios with every stale problem's entry left out, and what was left out."""
    stale = stale_problems(ratios, reference)
    kept = json.loads(json.dumps(ratios))
    for gpu, problem_ids in stale.items():
        for problem_id in problem_ids:
            del kept["gpus"][gpu]["problems"][problem_id]
    return kept, stale


def versions() -> dict:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}


def measure_into(out: Path, reference: PackageSpec, problem_ids: list[str], calls: int = CALLS) -> str:
    """Measure this GPU's ratios of `problem_ids` and store them in `out` beside other GPU models' and, where they
    were measured with the same torch, triton, CUDA and number of calls, beside this GPU's ratios of other problems
    (so that one problem can be measured again alone); returns the GPU's name."""
    gpu = torch.cuda.get_device_name(0)
    entry = {"versions": versions(), "calls": calls, "problems": {}}
    merge_into(out, {"gpus": {gpu: entry}})  # first drops the GPU's ratios measured with other versions or calls
    for problem_id, measured in measure_gpu(reference, problem_ids, calls):
        merge_into(out, {"gpus": {gpu: {**entry, "problems": {problem_id: measured}}}})
    return gpu


def median_of(passes: list[dict]) -> dict:
    """The passes' ratios (each a ratios file's content) as one: for every GPU, problem and case that every pass
    measured with the same versions, calls and digests, the case as measured in the pass of the median ratio (of an
    odd number of passes); a problem not measured alike in every pass is left out."""
    combined = {"format": FORMAT, "gpus": {}}
    for gpu, first in passes[0]["gpus"].items():
        entries = [measured["gpus"].get(gpu, {}) for measured in passes]
        if any((e.get("versions"), e.get("calls")) != (first["versions"], first["calls"]) for e in entries):
            continue
        problems = {}
        for problem_id, problem in first["problems"].items():
            alike = [e["problems"].get(problem_id) for e in entries]
            if any(a is None or a["digests"] != problem["digests"] for a in alike):
                continue
            cases = {}
            for case in problem["cases"]:
                ranked = sorted((a["cases"][case] for a in alike if case in a["cases"]),
                                key=lambda measured: measured["reference_over_baseline"])
                if len(ranked) == len(alike):
                    cases[case] = ranked[len(ranked) // 2]
            problems[problem_id] = {"digests": problem["digests"], "cases": cases, "passes": len(passes)}
        combined["gpus"][gpu] = {"versions": first["versions"], "calls": first["calls"], "problems": problems}
    return combined


def merge_into(out: Path, measured: dict) -> None:
    """`measured`'s problems written over those stored in `out` for the same GPU, versions and calls (other GPUs, and
    the GPU's other problems, kept)."""
    stored = json.loads(out.read_text()) if out.exists() else {"format": FORMAT, "gpus": {}}
    for gpu, entry in measured["gpus"].items():
        earlier = stored["gpus"].get(gpu, {})
        alike = (earlier.get("versions"), earlier.get("calls")) == (entry["versions"], entry["calls"])
        problems = {**(earlier.get("problems", {}) if alike else {}), **entry["problems"]}
        stored["gpus"][gpu] = {**entry, "problems": problems}
    out.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", default=RATIOS_FILE)
    parser.add_argument("--reference", default="reference")
    parser.add_argument("--problems", default=",".join(p.id for p in PROBLEMS if p.speed))
    parser.add_argument("--calls", type=int, default=CALLS)
    parser.add_argument("--median-of", type=Path, nargs="+", default=None, metavar="PASS",
                        help="write into OUT the median, case by case, of these passes' files (measures nothing)")
    args = parser.parse_args(argv)
    if args.median_of:
        if len(args.median_of) % 2 == 0:
            parser.error("--median-of takes an odd number of passes")
        merge_into(args.out, median_of([json.loads(path.read_text()) for path in args.median_of]))
        print(f"wrote the median of {len(args.median_of)} passes to {args.out}")
        return 0
    if not torch.cuda.is_available():
        print("speed ratios are measured on a GPU: none is visible here", file=sys.stderr)
        return 2
    gpu = measure_into(args.out, resolve(args.reference), args.problems.split(","), args.calls)
    print(f"wrote the {gpu}'s ratios to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
