"""Hostile: compiles its torch code under a file name inside Triton's package, so that the worker, which lets Triton's
own code call torch, takes the softmax computed there for Triton's; a Triton kernel then reads x and copies the
result into the output. It computes with exp and sum, not the softmax operator the problem forbids by name."""

import torch
import triton
import triton.language as tl

SOURCE = """
def computed_by_triton(x):
    shifted = x.float() - x.float().amax(dim=-1, keepdim=True)
    return (shifted.exp() / shifted.exp().sum(dim=-1, keepdim=True)).contiguous()
"""
NAMESPACE = {}
exec(compile(SOURCE, tl.core.__file__, "exec"), NAMESPACE)


@triton.jit
def _launder_kernel(x_ptr, result_ptr, scratch_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(scratch_ptr + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)
    tl.store(y_ptr + offsets, tl.load(result_ptr + offsets, mask=mask).to(y_ptr.dtype.element_ty), mask=mask)


def softmax(x):
    result = NAMESPACE["computed_by_triton"](x)
    y, scratch = torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(result)
    _launder_kernel[(triton.cdiv(x.numel(), 1024),)](x.contiguous(), result, scratch, y, x.numel(), BLOCK=1024)
    return y
