"""Which Triton versions may grade on the CPU path (Triton's interpreter)."""

from __future__ import annotations

import pytest

from grader.session import backend


@pytest.mark.parametrize("version, released", [("3.9.0", (3, 9)), ("3.10.1+git5", (3, 10)), ("3.9.0rc1", (3, 9)),
                                               ("4.0", (4, 0)), ("nightly", (0, 0))])
def test_release_reads_major_and_minor(version, released):
    assert backend.release(version) == released


def test_old_interpreter_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    refusal = backend.interpreter_refusal("3.6.0")
    assert refusal is not None and "triton 3.6.0" in refusal and "triton>=3.9" in refusal and "GPU" in refusal
    assert backend.interpreter_refusal("3.9.0") is None and backend.interpreter_refusal("3.11.2") is None


def test_a_gpu_takes_any_allowed_version(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert backend.interpreter_refusal("3.6.0") is None
