"""parallel.analysis's measured bubble is compared with the grader's measurement of the student's own pipeline.

One sheet answers the bubble of stages that run one after another (about 1 - 1/p = 0.75 at any m). Graded beside
the reference's pipeline, whose stages overlap, it fails and names the grader's measurement; graded beside a
pipeline whose stages wait for the whole batch (the mutant gpipe_stages_one_after_another), the same sheet passes.
"""

from __future__ import annotations

from tests import mutants
from tests.grading import ROOT, assert_fails_for, beside_parallel_sheet, run_grader

SERIAL_BUBBLES = {"measured_bubble_m4": 0.76, "measured_bubble_m16": 0.76}
SELECTION = ("--problem", "parallel.analysis", "-k", "measured_bubble")


def test_the_bubble_is_measured_on_the_students_pipeline(tmp_path):
    reference = (ROOT / "reference" / "parallel" / "pipeline.py").read_text()
    run = run_grader(beside_parallel_sheet(tmp_path / "overlapping", "pipeline", reference, SERIAL_BUBBLES), *SELECTION)
    assert_fails_for(run, "parallel.analysis", "measured_bubble", "measured_bubble_m4: you wrote 0.760",
                     "the grader measured")
    serial = mutants.load(mutants.WRONG / "parallel" / "pipeline" / "gpipe_stages_one_after_another")
    serial_package = beside_parallel_sheet(tmp_path / "serial", "pipeline", serial.source(), SERIAL_BUBBLES)
    run = run_grader(serial_package, *SELECTION)
    assert [t["status"] for t in run.tests_of("parallel.analysis")] == ["passed"], run.output[-3000:]


def test_an_unwritten_pipeline_leaves_the_question_not_implemented(tmp_path):
    """The sheet is answered but pipeline.py is still the stub: nothing to measure, so the question shows "not
    implemented" and names the problem it waits for, as a stub does."""
    stub = (ROOT / "student_impl" / "parallel" / "pipeline.py").read_text()
    run = run_grader(beside_parallel_sheet(tmp_path, "pipeline", stub, SERIAL_BUBBLES), *SELECTION)
    [test] = run.tests_of("parallel.analysis")
    assert test["output"].startswith("not implemented") and "parallel.pipeline is not implemented" in test["output"], (
        run.output[-3000:])
