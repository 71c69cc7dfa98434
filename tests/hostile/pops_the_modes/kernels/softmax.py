"""Hostile: pops every Python dispatch mode off the stack (the worker's operator recorder among them), computes the
softmax in torch, then has a Triton kernel read x and copy the result into the output."""

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import _disable_current_modes


@triton.jit
def _copy_kernel(x_ptr, result_ptr, scratch_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(scratch_ptr + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)
    tl.store(y_ptr + offsets, tl.load(result_ptr + offsets, mask=mask).to(y_ptr.dtype.element_ty), mask=mask)


def softmax(x):
    with _disable_current_modes():
        result = (x.float() - x.float().amax(-1, keepdim=True)).exp()
        result = (result / result.sum(-1, keepdim=True)).contiguous()
    y, scratch = torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(result)
    _copy_kernel[(triton.cdiv(x.numel(), 1024),)](x.contiguous(), result, scratch, y, x.numel(), BLOCK=1024)
    return y
