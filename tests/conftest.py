"""Tests of the grader itself. Triton's interpreter must be chosen before triton is first imported."""

from grader.backend import use_interpreter_without_gpu

use_interpreter_without_gpu()
