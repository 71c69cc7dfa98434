"""Speed thresholds: the student's kernel against the reference (and torch's own op) on one GPU, in one run.

Calls alternate (student, reference, torch baseline) so that clocks, temperature and other load affect all three
alike; each call gets fresh inputs from its own seed and a cold L2. The student's call is timed in its worker, the
others here, with the same code (grader.timing). Every timed student output is re-checked at positions drawn after
the call. Points come in tiers by the ratio of median times, student over reference.
"""

from __future__ import annotations

import functools
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from assignment.registry import SpeedThreshold
from grader.budget import untimed
from grader.outcomes import WrongAnswer
from grader.timing import Timer, sample

CALLS = 30
WARMUP_CALLS = 3  # compile, autotune and allocate before anything is timed; the rules are checked on these


@dataclass
class SpeedVerdict:
    student_ms: float
    reference_ms: float
    baseline_ms: float
    fraction: float

    @property
    def ratio(self) -> float:
        return self.student_ms / self.reference_ms

    @property
    def baseline_ratio(self) -> float:
        return self.student_ms / self.baseline_ms

    def describe(self, case: str) -> str:
        return (
            f"{case}: {self.student_ms * 1e3:.0f} us, {self.ratio:.2f}x the reference ({self.reference_ms * 1e3:.0f} "
            f"us) and {self.baseline_ratio:.2f}x torch ({self.baseline_ms * 1e3:.0f} us): "
            f"{self.fraction:.0%} of the speed points"
        )


def tier_fraction(ratio: float, threshold: SpeedThreshold) -> float:
    for max_ratio, fraction in threshold.tiers:
        if ratio <= max_ratio:
            return fraction
    return 0.0


def check_sample(student_sample: torch.Tensor, reference_sample: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    scale = float(reference_sample.abs().max()) or 1.0
    allowed = 16 * torch.finfo(dtype).eps * scale
    error = float((student_sample - reference_sample).abs().max())
    if not error <= allowed:  # also catches NaN
        raise WrongAnswer(f"{what}: a timed output differs from the reference by {error:.3g} (allowed {allowed:.3g})")


def measure(student, function: str, reference_fn, baseline_fn, inputs, case: tuple, threshold: SpeedThreshold,
            dtype: torch.dtype, calls: int = CALLS, seed: int | None = None,
            harness: Callable | None = None) -> SpeedVerdict:
    """Time `calls` alternating calls; `inputs` is a test-module function `inputs(*case, seed, device)`. With a
    `harness` (a test-module function), each timed call is harness(function, *args) instead of function(*args)."""
    inputs_name = f"{inputs.__module__}:{inputs.__name__}"
    harness_name = None
    if harness is not None:
        harness_name = f"{harness.__module__}:{harness.__name__}"
        reference_fn, baseline_fn = functools.partial(harness, reference_fn), functools.partial(harness, baseline_fn)
    device = torch.device("cuda")
    timer = Timer(device)
    draw = random.Random(seed)
    times = {"student": [], "reference": [], "baseline": []}
    for index in range(WARMUP_CALLS + calls):
        call_seed = draw.randrange(2**31)
        args = inputs(*case, seed=call_seed, device=device)
        student_ms = student.time_call(function, inputs_name, case, call_seed, check_rules=index < WARMUP_CALLS,
                                       harness=harness_name)
        reference_ms, reference_output = timer.time_ms(reference_fn, args)
        baseline_ms, _ = timer.time_ms(baseline_fn, args)
        sample_seed = draw.randrange(2**31)
        check_sample(student.sample_last_output(sample_seed), sample(reference_output, sample_seed), dtype,
                     f"{function}() on {case}")
        if index >= WARMUP_CALLS:
            times["student"].append(student_ms)
            times["reference"].append(reference_ms)
            times["baseline"].append(baseline_ms)
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = medians["student"] / medians["reference"]
    return SpeedVerdict(medians["student"], medians["reference"], medians["baseline"], tier_fraction(ratio, threshold))


def one_tensor(shape: tuple[int, ...], dtype: str, seed: int, device: torch.device) -> tuple[torch.Tensor]:
    """Inputs for a kernel of one tensor argument: standard normal values."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=generator, device=device, dtype=getattr(torch, dtype)),)


@dataclass(frozen=True)
class SpeedSpec:
    """What a problem's speed test times: the student's `function`, the reference's function of the same name, a torch
    `baseline` on the same arguments, and `inputs(shape, dtype, seed, device)` (a module-level function of the test
    module, so that the worker can build the same inputs). With a `harness(function, *args)` (also a module-level
    function of the test module), that is what is timed for all three instead of `function(*args)`: a forward and
    backward pass, say; its return value is the output that is sampled."""

    function: str
    baseline: Callable
    inputs: Callable
    harness: Callable | None = None

    def run(self, student, reference_module, case: tuple, threshold: SpeedThreshold, seed: int | None = None):
        shape, dtype = case
        return measure(student, self.function, getattr(untimed(reference_module), self.function), self.baseline, self.inputs,
                       case, threshold, getattr(torch, dtype), seed=seed, harness=self.harness)


def grade_speed(spec: SpeedSpec, student, reference_module, case: tuple, threshold: SpeedThreshold,
                partial_credit) -> None:
    """The body of a problem's `test_speed`: fails below the last tier, else awards the tier's fraction."""
    verdict = spec.run(student, reference_module, case, threshold)
    message = verdict.describe(f"{case[0]} {case[1]}")
    if verdict.fraction == 0:
        raise WrongAnswer(message)
    partial_credit(verdict.fraction, message)
