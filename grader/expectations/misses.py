"""A missing expectation is never a verdict: the example is rejected, or the test is "not graded"."""

from __future__ import annotations

import hypothesis


class DrawsDiffer(BaseException):
    """The inputs drawn here are not the recorded ones: no verdict can be given from the stored expectations."""

    status = "not graded"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


_misses = 0  # in the running test


def miss(what: str):
    """No record for this example: reject it (it is not a verdict); outside hypothesis, say the draws differ."""
    global _misses
    _misses += 1
    if hypothesis.currently_in_test_context():
        hypothesis.reject()
    raise DrawsDiffer(f"no stored expectation for {what}: the inputs drawn here (or the outputs of your code that the "
                      "test passes to the reference) are not those recorded")


def reset() -> None:
    global _misses
    _misses = 0


def misses_in_test() -> int:
    return _misses
