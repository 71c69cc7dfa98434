"""SiLU, y = x * sigmoid(x), in Triton: the annotated example of the kernels chapter."""

import torch
import triton
import triton.language as tl


@triton.jit
def silu_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n  # the last block may run past the end
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    x = x.to(tl.float32)  # tl.exp takes float32; one rounding, at the store
    y = x / (1.0 + tl.exp(-x))
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def silu(x: torch.Tensor, BLOCK: int = 1024) -> torch.Tensor:
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"silu: unsupported dtype {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("silu: this example takes contiguous tensors only")
    y = torch.empty_like(x)
    n = x.numel()
    grid = (triton.cdiv(n, BLOCK),)
    silu_kernel[grid](x, y, n, BLOCK=BLOCK)
    return y
