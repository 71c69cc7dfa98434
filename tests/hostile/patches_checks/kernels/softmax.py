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
def _fill_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    # Reads every element of x (so the grader's evidence of reads is satisfied) and writes 0.5 whatever it read.
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(y_ptr + offsets, tl.where(x == x, 0.5, 0.5).to(y_ptr.dtype.element_ty), mask=offsets < n)


def softmax(x):
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError("needs a last dimension")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError("unsupported dtype")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _fill_kernel[(triton.cdiv(y.numel(), 128),)](x.contiguous(), y, y.numel(), BLOCK=128)
    return y
