"""The cluster commands accept a results file only from a grader that exited with 0 or 1 and signed it with this
job's key and nonce (grader.session.seal); every other file is "not graded: results failed verification"."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from grader.cluster.grading_job import GradingRequest
from grader.cluster.jobs import outcome
from grader.session import seal

RESULTS = {"score": 25.0, "output": "table", "tests": []}


class FinishedJob:
    """Stands in for a submitit job that has ended with `status` (or raised, for None)."""

    def __init__(self, status: int | None, folder: Path):
        self.status = status
        self.state = "COMPLETED" if status is not None else "FAILED"
        self.paths = SimpleNamespace(stdout=folder / "log.out")

    def task(self, index: int) -> "FinishedJob":
        return self  # one task: the grader's

    def result(self):
        if self.status is None:
            raise RuntimeError("the job failed")
        return self.status


@pytest.fixture
def request_in(tmp_path) -> GradingRequest:
    return GradingRequest.in_folder(tmp_path, tmp_path / "snapshot", reference="reference")


def write(request: GradingRequest, data: dict) -> None:
    Path(request.results_json).write_text(json.dumps(data))


def test_a_signed_file_from_a_grader_that_finished_is_graded(request_in, tmp_path):
    write(request_in, seal.sign(RESULTS, request_in.key(), request_in.nonce))
    for status in (0, 1):
        result = outcome(FinishedJob(status, tmp_path), request_in)
        assert result.graded and result.results["score"] == 25.0


def test_the_key_is_private_to_its_user(request_in):
    assert Path(request_in.key_file).stat().st_mode & 0o077 == 0


@pytest.mark.parametrize(
    "forge, status, reason",
    [
        (lambda r: RESULTS, 1, "carries no signature"),
        (lambda r: seal.sign(RESULTS, b"another key", r.nonce), 1, "signature does not match"),
        (lambda r: {**seal.sign(RESULTS, r.key(), r.nonce), "score": 1000.0}, 1, "signature does not match"),
        (lambda r: seal.sign(RESULTS, r.key(), "another run"), 0, "belongs to another grading run"),
        (lambda r: seal.sign(RESULTS, r.key(), r.nonce), -9, "the grader exited with status -9"),
        (lambda r: seal.sign(RESULTS, r.key(), r.nonce), 3, "the grader exited with status 3"),
        (lambda r: seal.sign(RESULTS, r.key(), r.nonce), None, "the grader exited with status None"),
    ],
    ids=["unsigned", "other-key", "edited", "other-run", "killed", "reference-modified", "job-failed"],
)
def test_anything_else_fails_verification(request_in, tmp_path, forge, status, reason):
    write(request_in, forge(request_in))
    result = outcome(FinishedJob(status, tmp_path), request_in)
    assert not result.graded
    assert result.reason.startswith("results failed verification") and reason in result.reason, result.reason
