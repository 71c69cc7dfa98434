"""Hostile: computes the softmax in numpy on the input's memory, read through ctypes where torch sees no operator,
moves the result into a tensor with ctypes.memmove, and has a Triton kernel read x and copy that tensor into the
output, so that every check of launches and traffic is met. CPU only: the pointers are host memory."""

import ctypes

import numpy as np
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
    flat = x.contiguous().float()
    values = np.frombuffer((ctypes.c_float * flat.numel()).from_address(flat.data_ptr()), dtype=np.float32)
    values = values.reshape(flat.shape)
    exps = np.exp(values - values.max(axis=-1, keepdims=True))
    probabilities = np.ascontiguousarray(exps / exps.sum(axis=-1, keepdims=True), dtype=np.float32)
    result = torch.empty_like(flat)
    ctypes.memmove(result.data_ptr(), probabilities.ctypes.data, probabilities.nbytes)
    y, scratch = torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(flat)
    _launder_kernel[(triton.cdiv(x.numel(), 1024),)](x.contiguous(), result, scratch, y, x.numel(), BLOCK=1024)
    return y
