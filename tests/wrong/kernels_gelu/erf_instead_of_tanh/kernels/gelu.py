"""GeLU, written in Triton.

Wrong on purpose: it computes the exact GeLU 0.5 * x * (1 + erf(x / sqrt(2))) instead of the tanh approximation
the contract asks for; the two differ by up to about 5e-4.
"""

import math

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INV_SQRT_2 = 1.0 / math.sqrt(2.0)
BLOCK_SIZE = 1024


@triton.jit
def _gelu_kernel(x_ptr, y_ptr, n_elements, x_stride, INV_SQRT_2: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets * x_stride, mask=mask).to(tl.float32)
    # erf saturates at +-1 without overflowing, so large |x| needs no special care.
    y = 0.5 * x * (1.0 + tl.erf(x * INV_SQRT_2))
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU of every element of `x`, in float32, cast to the input dtype at the end."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"gelu expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"gelu supports float32, float16 and bfloat16, got {x.dtype}")

    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_elements = y.numel()
    if n_elements == 0:
        return y
    # One stride for all elements: a view when the dims allow it (contiguous, sliced), a copy otherwise.
    x_flat = x.reshape(-1)
    grid = (triton.cdiv(n_elements, BLOCK_SIZE),)
    _gelu_kernel[grid](x_flat, y, n_elements, x_flat.stride(0), INV_SQRT_2=INV_SQRT_2, BLOCK=BLOCK_SIZE)
    return y
