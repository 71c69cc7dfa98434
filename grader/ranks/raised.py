"""Invalid-argument checks in rank processes: which exception each attempted call raised."""

from __future__ import annotations

from collections.abc import Callable

from grader.checks.outcomes import WrongAnswer


def raised_by(attempts: dict[str, Callable[[], object]]) -> dict[str, dict | None]:
    """For each named call, what it raised, or None if it returned: {"classes": the class names of the error (its
    class first, then its bases), "message": "Class: message"}. NotImplementedError propagates, so that a stub is
    reported as not implemented, not as a wrong error."""
    raised = {}
    for call, attempt in attempts.items():
        try:
            attempt()
            raised[call] = None
        except NotImplementedError:
            raise
        except Exception as error:  # noqa: BLE001 - the kind of error is what is graded
            raised[call] = {"classes": [cls.__name__ for cls in type(error).__mro__],
                            "message": f"{type(error).__name__}: {error}"}
    return raised


def not_raising(raised: dict[str, dict | None], expected: str, with_message: bool = False) -> list[tuple[str, str]]:
    """(call, what it did instead) for each call of `raised` (raised_by's result) that did not raise `expected` or a
    subclass of it. What it raised instead is named by its class, or with_message by its class and message."""
    def instead(error: dict | None) -> str:
        if error is None:
            return "it returned normally"
        return f"it raised {error['message'] if with_message else error['classes'][0]}"

    return [(call, instead(error)) for call, error in raised.items()
            if error is None or expected not in error["classes"]]


def check_value_errors(raised_per_rank: list[dict[str, dict | None]]) -> None:
    """Fail on the first call, of any rank, that did not raise ValueError; each call is named "f(...): why"."""
    world_size = len(raised_per_rank)
    for rank, raised in enumerate(raised_per_rank):
        for call, got in not_raising(raised, "ValueError"):
            subject, _, why = call.partition("): ")
            raise WrongAnswer(f"{subject}) on rank {rank} of {world_size} (N={world_size}) must raise ValueError: "
                              f"{why}; {got}")
