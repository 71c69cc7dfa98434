"""`--dump-failing DIR`: the inputs of each problem's first failing test, saved with a snippet that calls the
student's function on them again, outside the grader.

The inputs are the last call of the student's function that the test sent to the worker: hypothesis replays the
failing example last, so that call is the failing example's, and what is saved is the message the worker decoded
(torch.save of its args and kwargs, views with their strides and offsets kept). Tests whose student code runs as a
grader program or on ranks send no such call: nothing is saved for them.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from grader.sandbox.client import Sandbox
from grader.session.packages import PackageSpec

# Characters a dumped file's name keeps from the test's name; any other becomes "_" (no separator, no "..").
UNSAFE_NAME_CHARACTERS = re.compile(r"[^A-Za-z0-9_.-]|\.\.+")


class RecordingSandbox(Sandbox):
    """A Sandbox that keeps its test's last call of a student function: (function, the message sent)."""

    last_call: tuple[str, bytes] | None = None

    def begin_test(self, budget) -> None:
        super().begin_test(budget)
        self.last_call = None

    def send(self, message: dict) -> bytes:
        data = super().send(message)
        if message.get("op") == "call":
            self.last_call = (message["function"], data)
        return data


def file_stem(problem_id: str, test_name: str) -> str:
    return UNSAFE_NAME_CHARACTERS.sub("_", f"{problem_id}__{test_name}")


def snippet(impl: PackageSpec, problem_id: str, function: str, interpreted: bool) -> str:
    """Three lines: load the saved call beside this file, import the student's module as the grader does (its
    package's parent on sys.path), call the function and print what it returned."""
    interpreter = 'os.environ.setdefault("TRITON_INTERPRET", "1"); ' if interpreted else ""
    return (f"import importlib, os, sys; {interpreter}sys.path.insert(0, {str(impl.path.parent)!r}); import torch\n"
            'call = torch.load(__file__.removesuffix(".py") + ".pt", weights_only=True)\n'
            f"output = importlib.import_module({f'{impl.name}.{problem_id}'!r}).{function}(*call['args'], "
            "**call['kwargs']); print(output)\n")


def write_regular_file(folder: Path, name: str, data: bytes) -> Path:
    """folder/name as a new regular file, written whole: a temporary file in `folder` renamed over the name, so that a
    link already there is replaced, never followed."""
    descriptor, temporary = tempfile.mkstemp(dir=folder, prefix=".dump-")
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        os.chmod(temporary, 0o644)  # mkstemp's 0o600 would keep a course assistant helping with it from reading it
        os.replace(temporary, folder / name)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return folder / name


def dump(folder: Path, impl: PackageSpec, problem_id: str, test_name: str, call: tuple[str, bytes],
         interpreted: bool) -> Path:
    """Save the call's inputs as folder/<problem>__<test>.pt and the snippet as .py beside them; the snippet's path."""
    function, message = call
    stem = file_stem(problem_id, test_name)
    write_regular_file(folder, f"{stem}.pt", message)
    return write_regular_file(folder, f"{stem}.py", snippet(impl, problem_id, function, interpreted).encode())
