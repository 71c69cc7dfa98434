"""GeLU, tanh approximation, written in Triton.

Wrong on purpose: the GeLU is computed by torch.nn.functional.gelu in the wrapper; the Triton kernel only copies
the result into the output.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_SIZE = 1024


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n_elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    values = tl.load(src_ptr + offsets, mask=mask)
    tl.store(dst_ptr + offsets, values.to(dst_ptr.dtype.element_ty), mask=mask)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU (tanh approximation) of every element of `x`, in float32, cast to the input dtype at the end."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"gelu expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"gelu supports float32, float16 and bfloat16, got {x.dtype}")

    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    # A new contiguous float32 tensor, so the copy can treat both sides as flat arrays.
    activations = F.gelu(x.float(), approximate="tanh").contiguous()
    _copy_kernel[(triton.cdiv(y.numel(), BLOCK_SIZE),)](activations, y, y.numel(), BLOCK=BLOCK_SIZE)
    return y
