"""Loads the grader's pytest plugin for `pytest grader`.

Triton's interpreter must be chosen before triton is first imported, so that comes first; and before it, in the
students' copy, the GPUs are hidden (its stored expectations are the CPU's draws).
"""

from grader.expectations import hide_gpus_in_students_copy
from grader.session.backend import use_interpreter_without_gpu

hide_gpus_in_students_copy()
use_interpreter_without_gpu()

from grader.plugin import *  # noqa: E402,F403 - pytest finds the plugin's hooks and fixtures here
