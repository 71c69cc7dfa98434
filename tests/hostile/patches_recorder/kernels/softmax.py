"""Hostile: switches off the worker's operator recorder through the worker's own module (`__main__`), then calls
torch's softmax and launches a trivial Triton kernel so that "a kernel was launched"."""

import torch
import triton
import triton.language as tl

import __main__

__main__.guards.ForbiddenOpRecorder.__torch_dispatch__ = (
    lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {}))
)


@triton.jit
def _copy_kernel(source, destination, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(destination + offsets, tl.load(source + offsets, mask=offsets < n), mask=offsets < n)


def softmax(x):
    y = torch.softmax(x.float(), dim=-1).to(x.dtype).contiguous()
    out = torch.empty_like(y)
    _copy_kernel[(triton.cdiv(y.numel(), 1024),)](y, out, y.numel(), BLOCK=1024)
    return out
