"""The GPU's own trace of a Triton problem's call (grader.sandbox.gpu_kernels): torch's computing kernels are named,
its copies and fills are not, and a Triton kernel is found under the name its launch hook reports. GPU only."""

from __future__ import annotations

import pytest
import torch

from grader.sandbox import gpu_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the trace is the GPU's own")


def test_torch_computing_is_named_and_moving_bytes_is_not():
    x = torch.randn(64, 128, device="cuda")
    moved, computed = [], []
    with gpu_kernels.traced(moved):
        y = torch.zeros_like(x)
        y.copy_(x)
        x.to(torch.bfloat16).contiguous()
    with gpu_kernels.traced(computed):
        torch.softmax(x, dim=-1)
    assert moved and gpu_kernels.computing(moved, []) == [], moved
    assert gpu_kernels.computing(computed, []), computed


def test_a_triton_kernel_is_found_under_its_launch_name():
    import triton
    import triton.language as tl

    @triton.jit
    def doubling_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(y_ptr + offsets, 2 * tl.load(x_ptr + offsets, mask=mask), mask=mask)

    x = torch.randn(1000, device="cuda")
    y = torch.empty_like(x)
    doubling_kernel[(1,)](x, y, x.numel(), BLOCK=1024)  # compiled outside the trace
    names = []
    with gpu_kernels.traced(names):
        doubling_kernel[(1,)](x, y, x.numel(), BLOCK=1024)
    assert gpu_kernels.ran(names, "doubling_kernel"), names
    assert gpu_kernels.computing(names, ["doubling_kernel"]) == [], names
    torch.testing.assert_close(y, 2 * x)
