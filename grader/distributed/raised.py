"""Invalid-argument checks in rank processes: which exception each attempted call raised."""

from __future__ import annotations

from collections.abc import Callable

from grader.checks.outcomes import WrongAnswer


def raised_by(attempts: dict[str, Callable[[], object]]) -> dict[str, list[str] | None]:
    """For each named call, the class names of what it raised (its class first, then its bases), or None if it
    returned. NotImplementedError propagates, so that a stub is reported as not implemented, not as a wrong error."""
    raised = {}
    for call, attempt in attempts.items():
        try:
            attempt()
            raised[call] = None
        except NotImplementedError:
            raise
        except Exception as error:  # noqa: BLE001 - the kind of error is what is graded
            raised[call] = [cls.__name__ for cls in type(error).__mro__]
    return raised


def not_raising(raised: dict[str, list[str] | None], expected: str) -> list[tuple[str, str]]:
    """(call, what it did instead) for each call of `raised` (raised_by's result) that did not raise `expected` or a
    subclass of it."""
    return [(call, "it returned normally" if names is None else f"it raised {names[0]}")
            for call, names in raised.items() if names is None or expected not in names]


def check_value_errors(raised_per_rank: list[dict[str, list[str] | None]]) -> None:
    """Fail on the first call, of any rank, that did not raise ValueError; each call is named "f(...): why"."""
    world_size = len(raised_per_rank)
    for rank, raised in enumerate(raised_per_rank):
        for call, got in not_raising(raised, "ValueError"):
            subject, _, why = call.partition("): ")
            raise WrongAnswer(f"{subject}) on rank {rank} of {world_size} (N={world_size}) must raise ValueError: "
                              f"{why}; {got}")
