"""Hostile: replaces the comparison and timing functions a naive grader would trust, then returns garbage."""

import time

import torch
import torch.testing
import triton
import triton.language as tl

torch.testing.assert_close = lambda *args, **kwargs: None
torch.allclose = lambda *args, **kwargs: True
torch.Tensor.allclose = lambda *args, **kwargs: True
time.perf_counter = lambda: 0.0


@triton.jit
def _fill_kernel(y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.full([BLOCK], 0.5, tl.float32).to(y_ptr.dtype.element_ty), mask=offsets < n)


def softmax(x):
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError("needs a last dimension")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError("unsupported dtype")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _fill_kernel[(triton.cdiv(y.numel(), 128),)](y, y.numel(), BLOCK=128)
    return y
