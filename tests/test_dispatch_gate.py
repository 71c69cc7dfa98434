"""The dispatcher gate (grader.sandbox.dispatch_gate): a Triton problem's compute rule seen below Python dispatch, so
that switching the worker's operator recorder off no longer hides torch's computing."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.grading import ATTACKED_AND_BYSTANDER, ROOT, assert_fails_for, run_grader
from tests.test_source_policy import HOSTILE


def test_the_gate_sees_what_python_dispatch_does_not():
    """In a fresh process (the gate stays for a process' life): an allowlist recorder learns of torch's operators
    run with Python dispatch off, with the modes popped, in inference mode and in a thread; copies, allocation and
    what runs outside a recorder are not noted."""
    program = textwrap.dedent("""
        import threading
        import torch
        from torch.utils._python_dispatch import _disable_current_modes
        from grader.sandbox import guards
        from grader.sandbox.allowed_ops import ALLOWED_OPS

        guards.gate_compute_at_dispatcher()
        guards.watch_value_reads()
        x = torch.randn(8, 8)
        torch.mm(x, x)  # no recorder active: not noted anywhere
        recorder = guards.ForbiddenOpRecorder((), ALLOWED_OPS)
        with recorder:
            y = torch.empty_like(x)
            y.copy_(x)
            with torch._C._DisableTorchDispatch():
                torch.mm(x, x)
            with _disable_current_modes():
                x.exp()
            with torch.inference_mode():
                torch.softmax(x, -1)
            thread = threading.Thread(target=lambda: x.sum())
            thread.start()
            thread.join()
            x.untyped_storage().tolist()
        print(" ".join(recorder.computed))
    """)
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    computed = done.stdout.split("\n")[-2].split()
    # In inference mode the softmax may reach the gate as aten.softmax or as aten._softmax below it.
    assert {"aten.mm", "aten.exp", "aten.sum", "UntypedStorage.tolist()"} <= set(computed)
    assert {"aten.softmax", "aten._softmax"} & set(computed)
    assert not {"aten.empty_like", "aten.copy_"} & set(computed), computed


@pytest.mark.parametrize("variant, computed", [
    ("disables_dispatch", "aten._softmax"),
    ("pops_the_modes", "aten.exp"),
])
def test_switching_the_recorder_off_still_loses_the_points(tmp_path, variant, computed):
    """With the source policy off (it refuses both statically), the gate still names torch's computing."""
    impl = shutil.copytree(ROOT / "reference", tmp_path / "impl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(HOSTILE / variant / "kernels" / "softmax.py", impl / "kernels" / "softmax.py")
    run = run_grader(impl, *ATTACKED_AND_BYSTANDER, "--source-policy", "off")
    assert_fails_for(run, "kernels.softmax", "matches_reference_fp32", "outside a Triton kernel", computed)
    router = run.tests_of("moe.router")
    assert router and all(t["status"] == "passed" for t in router), run.output[-3000:]
