"""The kernels a GPU ran during a call, as the GPU's own tracing (CUPTI, through torch.profiler) reports them.

On a GPU, a Triton problem's call is traced by the profiler from before the call to after its last kernel finished.
What the trace holds was recorded by the driver's activity API, not by Python code in the student's reach: a kernel
the launch hook reports (grader.sandbox.triton_hooks) must appear in it by name, and any kernel that is neither one
of the call's Triton launches nor torch moving bytes (a copy, a fill) is torch computing on the GPU, whatever route
led to it (a Python mode switched off, an operator reached below the dispatcher). The trace object lives in the
worker, unnamed by the student's source (the source policy refuses the grader's modules and private attributes).
"""

from __future__ import annotations

import contextlib
import re
import warnings

import torch

# torch's kernels that move bytes without computing new values: copies and casts (`copy_`, `.contiguous()`, `.to()`),
# fills (`zeros`, `zero_`, `fill_`, and the cache flush of an autotuner's timing), and the copy engine's transfers.
MOVES_BYTES = re.compile(r"copy|fill|memset|memcpy", re.IGNORECASE)


@contextlib.contextmanager
def traced(into: list[str]):
    """Append to `into` the names of the kernels and transfers the GPU ran inside the block, each once (it waits for
    them)."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # that a profiler keeps one cycle's events: this one has one cycle
        trace = profile(activities=[ProfilerActivity.CUDA])
    with trace:
        yield
        torch.cuda.synchronize()
    into.extend(sorted({event.name for event in trace.events()
                        if event.device_type == torch.autograd.DeviceType.CUDA}))


def ran(kernel_names: list[str], launched: str) -> bool:
    """Whether the trace holds the Triton kernel `launched` (a JIT function's name, which Triton gives the compiled
    kernel)."""
    return launched in kernel_names


def computing(kernel_names: list[str], launched: list[str]) -> list[str]:
    """The kernels of a trace that are neither the call's Triton launches nor torch moving bytes."""
    return sorted({name for name in kernel_names if not MOVES_BYTES.search(name) and name not in launched})
