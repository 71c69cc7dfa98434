"""Hostile: computes softmax with torch's own operator on a helper thread (out of sight of a recorder that watches
only the calling thread), and launches a trivial Triton kernel so that "a kernel was launched"."""

import threading

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_kernel(source, destination, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(destination + offsets, tl.load(source + offsets, mask=offsets < n), mask=offsets < n)


def softmax(x):
    result = {}
    worker = threading.Thread(target=lambda: result.update(y=torch.softmax(x.float(), dim=-1).to(x.dtype)))
    worker.start()
    worker.join()
    y = result["y"].contiguous()
    out = torch.empty_like(y)
    _copy_kernel[(triton.cdiv(y.numel(), 1024),)](y, out, y.numel(), BLOCK=1024)
    return out
