"""Loads the grader's pytest plugin for `pytest grader`.

Triton's interpreter must be chosen before triton is first imported, so that comes first.
"""

from grader.backend import use_interpreter_without_gpu

use_interpreter_without_gpu()

from grader.plugin import *  # noqa: E402,F401,F403 - pytest finds the plugin's hooks and fixtures here
