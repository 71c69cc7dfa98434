"""The score table printed at the end of `pytest grader`, and the results file in Gradescope's format.

Every message they show passes through `shown`: student text is made inert where it enters the grader's messages, and
again here, whatever way it came (grader.checks.inert).
"""

from __future__ import annotations

import platform

import torch

from grader.checks.inert import SHOWN_TEXT_CHARS, inert
from grader.session.scoring import ProblemScore, TestResult, by_problem

REASON_WIDTH = 90


def points(value: float) -> str:
    return f"{value:g}"


def shown(text: str) -> str:
    """A message as the summary, the score table and the results file show it: inert, at most SHOWN_TEXT_CHARS."""
    return inert(text, SHOWN_TEXT_CHARS)


def isolation_line(level: str, note: str = "") -> str:
    """The last line of every score table: which sandbox student code ran in (see grader.sandbox.isolation)."""
    return f"isolation: {level}" + (f" ({note})" if note else "")


def failure_summary(failed: list[TestResult]) -> list[str]:
    """Before the score table: for each problem, its first failure in full, then one line for each other failure."""
    lines = []
    for score in by_problem(failed):
        first, *others = score.results
        lines += [f"{score.problem.id}: {first.nodeid}", *("    " + line for line in shown(first.detail).splitlines())]
        for result in others:
            lines.append(f"{score.problem.id}: {result.nodeid}  {result.status}: {one_line(result.message)}")
        lines.append("")
    if lines:
        lines.append("(the first failure of each problem is shown in full; --details shows every one)")
    return lines


def one_line(text: str, width: int = REASON_WIDTH) -> str:
    text = shown(text)
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first if len(first) <= width else first[: width - 3] + "..."


def skipped_notes(scores: list[ProblemScore]) -> list[str]:
    """Why points were not graded here, one line per problem and reason (e.g. bf16 needs a GPU)."""
    notes: dict[tuple[str, str], float] = {}
    for score in scores:
        for result in score.results:
            if result.status == "skipped":
                key = (score.problem.id, one_line(result.message))
                notes[key] = notes.get(key, 0.0) + result.share
    return [f"not graded here: {problem_id}, {points(share)} points: {why}"
            for (problem_id, why), share in notes.items()]


def gpu_dtype_notes(scores: list[ProblemScore], gpu_only_dtypes: dict[str, tuple[str, ...]]) -> list[str]:
    """Which dtypes a problem graded here is graded in on a GPU only, left out of the tests that ran here rather than
    skipped with them: full marks here say nothing about them."""
    return [f"graded on submission: {score.problem.id}, {' and '.join(gpu_only_dtypes[score.problem.id])} inputs: "
            "drawn on a GPU only (the tests graded here drew its other dtypes)"
            for score in scores if gpu_only_dtypes.get(score.problem.id) and score.max_score > 0
            and score.status != "not implemented"]


def score_table(scores: list[ProblemScore], isolation: str = "",
                gpu_only_dtypes: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """The table, then why points were not graded here, what is graded on submission only (`gpu_only_dtypes`: by
    problem, the dtypes this machine does not draw), and the sandbox."""
    rows = [("problem", "status", "points", "reason")]
    for score in scores:
        reason = one_line(score.reason)
        rows.append(
            (score.problem.id, score.status, f"{points(score.score)}/{points(score.max_score)}", reason)
        )
    total = sum(s.score for s in scores)
    total_max = sum(s.max_score for s in scores)
    skipped = sum(s.skipped_points for s in scores)
    note = f"{points(skipped)} more points in tests skipped here" if skipped else ""
    rows.append(("total", "", f"{points(total)}/{points(total_max)}", note))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for index, row in enumerate(rows):
        if index in (1, len(rows) - 1):
            lines.append("-" * (sum(widths) + 6 + 20))
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3])
    return (lines + skipped_notes(scores) + gpu_dtype_notes(scores, gpu_only_dtypes or {})
            + ([isolation] if isolation else []))


def machine_description() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "machine": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "triton": triton_version,
    }


def results_json(results: list[TestResult], scores: list[ProblemScore], execution_time_s: float, extra: dict,
                 isolation: str = "", gpu_only_dtypes: dict[str, tuple[str, ...]] | None = None) -> dict:
    tests = []
    for problem_number, score in enumerate(scores, start=1):
        for test_number, result in enumerate(score.results, start=1):
            entry = {
                "name": f"{result.problem.id} :: {result.nodeid.split('::', 1)[-1]}",
                "number": f"{problem_number}.{test_number}",
                "score": result.score,
                "max_score": result.max_score,
                "output": (result.status if result.message in ("", result.status)
                           else f"{result.status}: {shown(result.message)}"),
                "visibility": "visible",
            }
            if result.status != "skipped":
                entry["status"] = "passed" if result.status == "passed" else "failed"
            else:
                entry["output"] = f"skipped: {shown(result.message)} ({points(result.share)} points not graded here)"
            tests.append(entry)
    return {
        "score": sum(s.score for s in scores),
        "execution_time": int(round(execution_time_s)),
        "output": "\n".join(score_table(scores, isolation, gpu_only_dtypes)),
        "tests": tests,
        "extra_data": {**machine_description(), **extra},
    }

