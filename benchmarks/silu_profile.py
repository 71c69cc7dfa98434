"""A torch.profiler trace of the handout's annotated SiLU kernel, kept as the data the handout's trace figure draws.

    python benchmarks/silu_profile.py [OUT.json]   (a GPU; default assignment/handout/data/silu_profile.json)

Five calls of the example's `silu` and five copies of the same tensor (`y.copy_(x)`), launched back to back after a
warm-up, at two sizes: a small tensor, where launching costs more than the kernel and the GPU waits between kernels,
and a large one, where the kernels are long and the GPU never waits. For each, the trace keeps the host's kernel
launches and the GPU's kernels, with times in microseconds from the first launch, and the GPU, torch and triton it
was measured with.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "assignment" / "handout" / "examples"))
from silu import silu  # the example is a file of the handout, not a package

OUT = ROOT / "assignment" / "handout" / "data" / "silu_profile.json"
SIZES = {"small": 1 << 16, "large": 8192 * 8192}
CALLS = 5


def trace(n: int) -> dict:
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    for _ in range(3):  # compile the kernel and warm both paths up outside the trace
        silu(x)
        y.copy_(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            silu(x)
        for _ in range(CALLS):
            y.copy_(x)
        torch.cuda.synchronize()
    launches, kernels = [], []
    for event in prof.events():
        start, end = event.time_range.start, event.time_range.end
        if event.device_type == DeviceType.CUDA:
            # A contiguous copy of one dtype is a device-to-device memcpy ("Memcpy DtoD"), started by
            # cudaMemcpyAsync rather than a kernel launch: the launches kept below are silu's alone.
            kind = "silu" if "silu" in event.name else "copy" if "memcpy" in event.name.lower() else "other"
            kernels.append({"kind": kind, "name": event.name, "start_us": start, "end_us": end})
        elif "LaunchKernel" in event.name:
            launches.append({"name": event.name, "start_us": start, "end_us": end})
    origin = min(e["start_us"] for e in launches + kernels)
    for event in launches + kernels:
        event["start_us"] = round(event["start_us"] - origin, 2)
        event["end_us"] = round(event["end_us"] - origin, 2)
    return {"n": n, "bytes_moved_per_call": 2 * n * x.element_size(),
            "launches": sorted(launches, key=lambda e: e["start_us"]),
            "kernels": sorted(kernels, key=lambda e: e["start_us"])}


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    traces = {name: trace(n) for name, n in SIZES.items()}
    measured = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
                "calls": CALLS, "dtype": "bfloat16", "traces": traces}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(measured, indent=1) + "\n")
    for name, kept in traces.items():
        spans = [(k["kind"], round(k["end_us"] - k["start_us"], 1)) for k in kept["kernels"]]
        print(name, kept["n"], spans)
    return 0


if __name__ == "__main__":
    sys.exit(main())
