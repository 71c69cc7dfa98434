"""Hostile: calls torch's softmax with torch's dispatch to Python modes switched off, so the worker's operator
recorder never sees it, then has a Triton kernel read x and copy the result into the output."""

import torch
import triton
import triton.language as tl


@triton.jit
def _launder_kernel(x_ptr, result_ptr, scratch_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(scratch_ptr + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)
    tl.store(y_ptr + offsets, tl.load(result_ptr + offsets, mask=mask).to(y_ptr.dtype.element_ty), mask=mask)


def softmax(x):
    with torch._C._DisableTorchDispatch():
        result = torch.softmax(x.float(), dim=-1).contiguous()
    y, scratch = torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(result)
    _launder_kernel[(triton.cdiv(x.numel(), 1024),)](x.contiguous(), result, scratch, y, x.numel(), BLOCK=1024)
    return y
