"""Hypothesis profiles. `public` is what students run, `grading` draws more and larger inputs from a secret seed,
`ci` is sized for Triton's interpreter on two CPU cores."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from assignment.registry import PROFILES, Problem

_COMMON = dict(
    report_multiple_bugs=False,
    # No "explain" phase: it re-runs failing examples many times to annotate lines, too slow behind a worker.
    # One failure, shrunk, is what a student can act on.
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
    deadline=None,  # interpreter and worker round trips make timings meaningless; the sandbox enforces time limits
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    print_blob=False,
)

# public and ci are derandomised: the same inputs every run, so a failure reproduces by running the test again.
settings.register_profile("public", derandomize=True, database=None, **_COMMON)
settings.register_profile("ci", derandomize=True, database=None, **_COMMON)
settings.register_profile("grading", derandomize=False, database=None, **_COMMON)


def draw_from_global_constants_only() -> None:
    """Hypothesis mixes numbers found in the source of every loaded local module into its draws, and caches them per
    kind of draw when first needed. Which modules are loaded differs between a whole run and one test, and between
    the live grader (which imports the reference) and the students' copy (which cannot): the same seed would draw
    other inputs, and neither a reproduction nor the stored expectations (grader.expectations) would hold. The
    grader's draws use hypothesis's own constants only."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:  # a hypothesis without local constants draws the same everywhere already
        return
    if hasattr(providers, "_get_local_constants"):
        empty = Constants()
        providers._get_local_constants = lambda: empty


draw_from_global_constants_only()

# How large drawn inputs may be, per profile: the interpreter costs ~0.1 ms per Triton op per program.
SIZE_SCALE = {"ci": 1, "public": 2, "grading": 4}


PROFILE_VARIABLE = "GRADER_PROFILE"


def load(profile: str) -> None:
    """Make `profile` the active one, in this process and (through the environment) in the processes it starts."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    settings.load_profile(profile)
    os.environ[PROFILE_VARIABLE] = profile


def without_shrinking() -> None:
    """The active profile, with no shrink phase: for grading from stored expectations, which hold no value for the
    inputs hypothesis would try while shrinking (grader.expectations). A failure then shows the first failing input
    drawn; the profiles draw small inputs first."""
    phases = tuple(phase for phase in settings().phases if phase != Phase.shrink)
    settings.register_profile(active(), parent=settings.get_profile(active()), phases=phases)
    settings.load_profile(active())


def active() -> str:
    return os.environ.get(PROFILE_VARIABLE, "public")


def examples(problem: Problem, fraction: float = 1.0, shrink: bool = True) -> settings:
    """The settings decorator giving a test `fraction` of its problem's example budget (at least one example).

    shrink=False suits tests whose every example is expensive (a launch of several ranks) and already small.
    """
    phases = settings().phases if shrink else tuple(p for p in settings().phases if p != Phase.shrink)
    return settings(max_examples=max(1, round(problem.budgets[active()] * fraction)), phases=phases)


def on_ranks(problem: Problem, world_sizes, **strategies):
    """A test of ranks: parametrised by `world_size` over `world_sizes`, and searched by hypothesis over
    `strategies` within the problem's example budget, without shrinking (every example is a launch of ranks, and
    already small). The same as stacking parametrize, examples(problem, shrink=False) and given: hypothesis reads no
    decorator into its seeds, so node ids and draws are those of the stack."""
    def decorate(function):
        searched = examples(problem, shrink=False)(given(**strategies)(function))
        return pytest.mark.parametrize("world_size", world_sizes)(searched)

    return decorate
