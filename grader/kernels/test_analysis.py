"""Grading kernels.analysis: the Triton kernels family's analysis questions, read from the student's answer sheet.

Derived answers are compared with the grader's derivation, written out below from each question's numbers. The copy-
bandwidth fractions, at two sizes, are measured: on a GPU the grader times the student's own softmax beside a copy,
exactly as the question says to, and the answer must be within MEASURED_REL_TOL (grader.checks.answers) of that;
without a GPU it can only check that each is consistent (a fraction of a copy), and says so.
"""

from __future__ import annotations

from grader.checks.answers import check_baseline_over_kernel, check_choice, check_derived, number
from grader.checks.marks import timed_on_gpu
from grader.checks.outcomes import WrongAnswer
from grader.kernels.speed_cases import SOFTMAX_BESIDE_COPY

# The softmax inputs of the two fractions, (shape, dtype) as the speed tests' cases: 128 MiB, then 1 MiB.
SOFTMAX_CASE = ((8192, 4096), "float32")
SMALL_SOFTMAX_CASE = ((256, 1024), "float32")
# A softmax cannot move its bytes much faster than a copy of them; timing noise may put it a little above.
MOST_COPY_FRACTION = 1.25


def check_copy_fraction(sheet, key: str, case: tuple, student_of, partial_credit) -> None:
    fraction = number(sheet, key)
    if not 0 < fraction <= MOST_COPY_FRACTION:
        raise WrongAnswer(f"{key}: {fraction:g} is not a fraction of copy bandwidth (0 to about 1)")
    softmax = student_of("kernels.softmax")  # a measurement needs the kernel written, on any machine
    check_baseline_over_kernel(key, fraction, SOFTMAX_BESIDE_COPY, softmax, case,
                               f"x.clone() over your softmax, {case[1]} {case[0]}, timed as the speed tests time",
                               partial_credit, "softmax")


@timed_on_gpu
def test_softmax_copy_fraction(sheet, student_of, partial_credit):
    check_copy_fraction(sheet, "softmax_copy_fraction", SOFTMAX_CASE, student_of, partial_credit)


@timed_on_gpu
def test_softmax_copy_fraction_small(sheet, student_of, partial_credit):
    check_copy_fraction(sheet, "softmax_copy_fraction_small", SMALL_SOFTMAX_CASE, student_of, partial_credit)


def test_softmax_small_reason(sheet):
    check_choice(sheet, "softmax_small_reason", "b", "abcd")


def test_matmul_tile_intensity(sheet):
    tile, k, element_bytes = 128, 4096, 2
    flops = 2 * tile * tile * k  # a multiply-add per (row, column, k)
    traffic = (tile * k + k * tile) * element_bytes + tile * tile * element_bytes  # two panels in, the tile out
    check_derived(sheet, "matmul_tile_intensity", flops / traffic, rel_tol=0.005)


def test_flash_key_blocks(sheet):
    query_blocks = 8192 // 128
    # Query block i (from 0) loads key blocks 0..i: the rest lie wholly above the diagonal.
    check_derived(sheet, "flash_key_blocks", sum(i + 1 for i in range(query_blocks)))
