"""GeLU, tanh approximation, written in Triton.

Wrong on purpose: the input is passed to the kernel as it is and read as if it were contiguous, so a
transposed or sliced view is read in storage order instead of in the order of its elements.
"""

import math

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
BLOCK_SIZE = 1024


@triton.jit
def _gelu_kernel(x_ptr, y_ptr, n_elements, x_stride, SQRT_2_OVER_PI: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets * x_stride, mask=mask).to(tl.float32)
    u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    # tanh(|u|) from exp(-2|u|), which lies in (0, 1] and cannot overflow; the sign is put back afterwards.
    e = tl.exp(-2.0 * tl.abs(u))
    tanh_abs = (1.0 - e) / (1.0 + e)
    tanh_u = tl.where(u >= 0, tanh_abs, -tanh_abs)
    y = 0.5 * x * (1.0 + tanh_u)
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU (tanh approximation) of every element of `x`, in float32, cast to the input dtype at the end."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"gelu expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"gelu supports float32, float16 and bfloat16, got {x.dtype}")

    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_elements = y.numel()
    if n_elements == 0:
        return y
    grid = (triton.cdiv(n_elements, BLOCK_SIZE),)
    # Elements are consecutive in memory, one apart.
    _gelu_kernel[grid](x, y, n_elements, 1, SQRT_2_OVER_PI=SQRT_2_OVER_PI, BLOCK=BLOCK_SIZE)
    return y
