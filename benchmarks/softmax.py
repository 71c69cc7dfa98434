"""Reference softmax against torch.softmax on one GPU, as a fraction of the measured copy bandwidth.

    python benchmarks/softmax.py            # prints the table and writes benchmarks/results/softmax.md

Softmax must read every element once and write it once, the same bytes as a device-to-device copy, so the copy's
bandwidth (measured here, on the same tensors' size) is its ceiling. Times are medians of CUDA-event timings
(triton.testing.do_bench), with the inputs rotated among several buffers so that no run is served from L2.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from reference.kernels.softmax import softmax  # noqa: E402

SHAPES = ((8192, 4096), (4096, 32768))
DTYPES = (torch.float32, torch.bfloat16)
BUFFERS = 4  # distinct inputs per measurement: 4 x 512 MiB at the largest size is far beyond the 60 MB L2


def median_ms(function, inputs: list[torch.Tensor]) -> float:
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(inputs)
        function(inputs[state["i"]])

    return triton.testing.do_bench(call, warmup=50, rep=300, return_mode="median")


def main() -> None:
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    rows = []
    for n_rows, n_cols in SHAPES:
        for dtype in DTYPES:
            inputs = [torch.randn(n_rows, n_cols, device="cuda", dtype=dtype) for _ in range(BUFFERS)]
            out = torch.empty_like(inputs[0])
            moved_bytes = 2 * inputs[0].numel() * inputs[0].element_size()  # read once, write once
            torch.testing.assert_close(softmax(inputs[0]), torch.softmax(inputs[0].float(), -1).to(dtype))
            copy_ms = median_ms(lambda x: out.copy_(x), inputs)
            ours_ms = median_ms(softmax, inputs)
            torch_ms = median_ms(lambda x: torch.softmax(x, -1), inputs)
            rows.append((f"{n_rows}x{n_cols}", str(dtype).removeprefix("torch."), copy_ms, ours_ms, torch_ms,
                         moved_bytes))
    header = "| shape | dtype | copy TB/s | reference TB/s | of copy | torch.softmax TB/s | reference / torch time |"
    lines = [header, "|" + " --- |" * 7]
    for shape, dtype, copy_ms, ours_ms, torch_ms, moved in rows:
        tbps = lambda ms: moved / ms / 1e9  # noqa: E731 - bytes per ms to TB/s
        lines.append(
            f"| {shape} | {dtype} | {tbps(copy_ms):.2f} | {tbps(ours_ms):.2f} | {copy_ms / ours_ms:.0%} | "
            f"{tbps(torch_ms):.2f} | {ours_ms / torch_ms:.2f} |"
        )
    versions = (
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
        f"python {platform.python_version()}"
    )
    report = "\n".join([f"# Softmax: reference against torch.softmax\n", versions, "", *lines, ""])
    print(report)
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    (results / "softmax.md").write_text(report)


if __name__ == "__main__":
    main()
