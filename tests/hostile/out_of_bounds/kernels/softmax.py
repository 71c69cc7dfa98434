"""Hostile: stores far past the end of its output, which without the grader's bounds check would corrupt memory
or segfault under Triton's interpreter."""

import torch
import triton
import triton.language as tl


@triton.jit
def _scribble_kernel(y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK) + (1 << 30)
    tl.store(y_ptr + offsets, tl.zeros([BLOCK], tl.float32).to(y_ptr.dtype.element_ty))


def softmax(x):
    y = torch.softmax(x.float(), dim=-1).to(x.dtype)
    _scribble_kernel[(1,)](y, y.numel(), BLOCK=64)
    return y
