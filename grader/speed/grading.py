"""Speed thresholds: the student's kernel against the reference (and a baseline: torch's own op) on one GPU, in one run.

Calls alternate (student, reference, baseline) so that clocks, temperature and other load affect all three alike;
each call gets fresh inputs from its own seed and a cold L2. The student's call is timed in its worker, the others
here, with the same code (grader.speed.timing). Every timed student output is re-checked at positions drawn after the
call. Points come in tiers by the ratio of median times, student over reference.

The students' copy has no reference. There the student alternates with the baseline alone, and the reference's time
is the baseline's times the ratio reference / baseline that the instructor measured on the same GPU model
(grader.speed.ratios, kept in RATIOS_FILE); the timed outputs are checked against the baseline's, or against the
spec's oracle where the baseline computes something else. On a GPU model with no stored ratio the speed line is
advisory: measured, shown, and its points left to the graded submission.
"""

from __future__ import annotations

import functools
import importlib
import json
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from assignment.registry import SpeedThreshold
from grader.checks.outcomes import WrongAnswer
from grader.session.budget import ReplayedReference, untimed
from grader.speed.timing import Timer, sample

CALLS = 30
WARMUP_CALLS = 3  # compile, autotune and allocate before anything is timed; the rules are checked on these
RATIOS_FILE = Path(__file__).with_name("ratios.json")
ON_SUBMISSION = "its points are awarded on submission, where the reference itself is timed"

# One timed side of a round: (round index, the round's input seed, its inputs) -> (milliseconds, output).
Runner = Callable[[int, int, tuple], tuple[float, object]]


@dataclass
class SpeedVerdict:
    student_ms: float
    reference_ms: float
    baseline_ms: float
    fraction: float
    estimated: bool = False  # reference_ms is the baseline's time times a stored ratio (the students' copy)

    @property
    def ratio(self) -> float:
        return self.student_ms / self.reference_ms

    @property
    def baseline_ratio(self) -> float:
        return self.student_ms / self.baseline_ms

    def describe(self, case: str) -> str:
        how = ", estimated from the baseline's time and the stored ratio" if self.estimated else ""
        return (
            f"{case}: {self.student_ms * 1e3:.0f} us, {self.ratio:.2f}x the reference ({self.reference_ms * 1e3:.0f} "
            f"us{how}) and {self.baseline_ratio:.2f}x torch ({self.baseline_ms * 1e3:.0f} us): "
            f"{self.fraction:.0%} of the speed points"
        )


def tier_fraction(ratio: float, threshold: SpeedThreshold) -> float:
    for max_ratio, fraction in threshold.tiers:
        if ratio <= max_ratio:
            return fraction
    return 0.0


def check_sample(student_sample: torch.Tensor, expected_sample: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """The timed output at the sampled positions is the expected one, within 16 ulp of the dtype at the largest
    expected value; positions where the expected value is NaN (an oracle that does not judge them) are skipped."""
    judged = ~expected_sample.isnan()
    student_sample, expected_sample = student_sample[judged], expected_sample[judged]
    scale = float(expected_sample.abs().max()) if expected_sample.numel() else 1.0
    allowed = 16 * torch.finfo(dtype).eps * (scale or 1.0)
    error = float((student_sample - expected_sample).abs().max()) if expected_sample.numel() else 0.0
    if not error <= allowed:  # also catches NaN
        raise WrongAnswer(f"{what}: a timed output differs from the expected one by {error:.3g} "
                          f"(allowed {allowed:.3g})")


def alternate(runners: dict[str, Runner], inputs: Callable, case: tuple, calls: int = CALLS, seed: int | None = None,
              after_round: Callable[[tuple, dict, int], None] | None = None) -> dict[str, float]:
    """The median milliseconds of each runner over `calls` rounds, after WARMUP_CALLS untimed ones. A round builds
    fresh inputs `inputs(*case, seed, device)` from its own seed and calls every runner on them in order; then
    after_round(inputs, outputs by runner, a seed drawn after the calls) may check what they returned."""
    device = torch.device("cuda")
    draw = random.Random(seed)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for index in range(WARMUP_CALLS + calls):
        call_seed = draw.randrange(2**31)
        args = inputs(*case, seed=call_seed, device=device)
        outputs = {}
        for name, run in runners.items():
            milliseconds, outputs[name] = run(index, call_seed, args)
            if index >= WARMUP_CALLS:
                times[name].append(milliseconds)
        if after_round is not None:
            after_round(args, outputs, draw.randrange(2**31))
    return {name: statistics.median(values) for name, values in times.items()}


def grader_runner(timer: Timer, function: Callable) -> Runner:
    return lambda index, call_seed, args: timer.time_ms(function, args)


@dataclass(frozen=True)
class SpeedSpec:
    """What a problem's speed test times: the student's `function`, the reference's function of the same name, a torch
    `baseline` on the same arguments, and `inputs(shape, dtype, seed, device)` (a module-level function of the test
    module, so that the worker can build the same inputs). With a `harness(function, *args)` (also a module-level
    function of the test module), that is what is timed for all three instead of `function(*args)`: a forward and
    backward pass, say; its return value is the output that is sampled. Where the baseline computes another function
    than the problem's, `oracle(args, seed)` gives the true output at the positions
    grader.speed.timing.sample(output, seed) takes, for the students' copy to check against."""

    function: str
    baseline: Callable
    inputs: Callable
    harness: Callable | None = None
    oracle: Callable | None = None

    def timed(self, function: Callable) -> Callable:
        return function if self.harness is None else functools.partial(self.harness, function)

    def expected_sample(self, args: tuple, baseline_output, seed: int) -> torch.Tensor:
        """The true output at the positions `seed` samples, from the baseline's output or the oracle."""
        return sample(baseline_output, seed) if self.oracle is None else self.oracle(args, seed)

    def student_runner(self, student, case: tuple) -> Runner:
        inputs_name = f"{self.inputs.__module__}:{self.inputs.__name__}"
        harness_name = None if self.harness is None else f"{self.harness.__module__}:{self.harness.__name__}"

        def run(index: int, call_seed: int, args: tuple) -> tuple[float, None]:
            return student.time_call(self.function, inputs_name, case, call_seed, check_rules=index < WARMUP_CALLS,
                                     harness=harness_name), None

        return run

    def run(self, student, reference_module, case: tuple, threshold: SpeedThreshold,
            seed: int | None = None) -> SpeedVerdict:
        """The student against the reference and the baseline, in one run."""
        timer = Timer(torch.device("cuda"))
        runners = {"student": self.student_runner(student, case),
                   "reference": grader_runner(timer, self.timed(getattr(reference_module, self.function))),
                   "baseline": grader_runner(timer, self.timed(self.baseline))}

        def check(args, outputs, sample_seed):
            check_sample(student.sample_last_output(sample_seed), sample(outputs["reference"], sample_seed),
                         getattr(torch, case[1]), f"{self.function}() on {case}")

        medians = alternate(runners, self.inputs, case, seed=seed, after_round=check)
        return SpeedVerdict(medians["student"], medians["reference"], medians["baseline"],
                            tier_fraction(medians["student"] / medians["reference"], threshold))

    def against_baseline(self, student, case: tuple, seed: int | None = None) -> dict[str, float]:
        """The median milliseconds of the student ("student") and the baseline ("baseline") alternating, each timed
        student output checked against the baseline's or the oracle's."""
        runners = {"student": self.student_runner(student, case),
                   "baseline": grader_runner(Timer(torch.device("cuda")), self.timed(self.baseline))}

        def check(args, outputs, sample_seed):
            check_sample(student.sample_last_output(sample_seed),
                         self.expected_sample(args, outputs["baseline"], sample_seed), getattr(torch, case[1]),
                         f"{self.function}() on {case}")

        return alternate(runners, self.inputs, case, seed=seed, after_round=check)

    def run_from_ratio(self, student, case: tuple, threshold: SpeedThreshold, reference_over_baseline: float | None,
                       seed: int | None = None) -> SpeedVerdict:
        """The student against the baseline alone, the reference's time estimated from the stored ratio; without
        one, the verdict earns nothing (its reference_ms is NaN)."""
        medians = self.against_baseline(student, case, seed)
        if reference_over_baseline is None:
            return SpeedVerdict(medians["student"], float("nan"), medians["baseline"], 0.0, estimated=True)
        reference_ms = medians["baseline"] * reference_over_baseline
        return SpeedVerdict(medians["student"], reference_ms, medians["baseline"],
                            tier_fraction(medians["student"] / reference_ms, threshold), estimated=True)


def speed_spec(problem_id: str) -> SpeedSpec | None:
    """The problem's SpeedSpec (in its family's grader.<family>.speed_cases), or None when it is timed otherwise (on
    several GPUs: grader.ranks.step_time) or not at all."""
    try:
        module = importlib.import_module(f"grader.{problem_id.split('.')[0]}.speed_cases")
    except ModuleNotFoundError:
        return None
    return module.SPEEDS.get(problem_id)


def case_key(case: tuple) -> str:
    """The key of one speed case in RATIOS_FILE: its id in the speed test's parametrisation."""
    return str(case)


def stored_ratios(path: Path = RATIOS_FILE) -> dict:
    """{GPU model: {"problems": {problem id: {"cases": {case key: {"reference_over_baseline": ...}}}}}}, as
    grader.speed.ratios measured them."""
    try:
        return json.loads(path.read_text()).get("gpus", {})
    except (OSError, ValueError):
        return {}


def stored_ratio(gpu: str, problem_id: str, case: tuple) -> tuple[float | None, str]:
    """(reference / baseline measured on this GPU model for the case, or None and why not)."""
    ratios = stored_ratios()
    if gpu not in ratios:
        measured = ", ".join(sorted(ratios)) or "none"
        return None, f"no reference time is stored for the {gpu} (measured on: {measured})"
    entry = ratios[gpu].get("problems", {}).get(problem_id, {}).get("cases", {}).get(case_key(case))
    if entry is None:
        return None, f"no reference time is stored for {problem_id} {case} on the {gpu}"
    return entry["reference_over_baseline"], ""


def grade_speed(spec: SpeedSpec, student, reference, case: tuple, threshold: SpeedThreshold,
                partial_credit) -> None:
    """The body of a problem's `test_speed`: fails below the last tier, else awards the tier's fraction. In the
    students' copy, the verdict rests on the stored ratio; without one it is advisory (a skip that says so)."""
    shown = f"{case[0]} {case[1]}"
    if isinstance(reference, ReplayedReference):
        gpu = torch.cuda.get_device_name(0)
        ratio, missing = stored_ratio(gpu, student.problem_id, case)
        verdict = spec.run_from_ratio(student, case, threshold, ratio)
        if ratio is None:
            pytest.skip(f"advisory: {shown}: {verdict.student_ms * 1e3:.0f} us, {verdict.baseline_ratio:.2f}x torch "
                        f"({verdict.baseline_ms * 1e3:.0f} us); {missing}: {ON_SUBMISSION}")
    else:
        verdict = spec.run(student, untimed(reference), case, threshold)
    message = verdict.describe(shown)
    if verdict.fraction == 0:
        raise WrongAnswer(message)
    partial_credit(verdict.fraction, message)


