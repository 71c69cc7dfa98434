"""Row sums (a sum over the last dimension), written in Triton.

Wrong on purpose: the sums are computed by Tensor.sum in the wrapper; the Triton kernel only copies them into the
output.
"""

import torch
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


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension of `x`, accumulated in float32, cast to the input dtype at the end."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"row_sum expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"row_sum supports float32, float16 and bfloat16, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("row_sum needs at least one dimension")
    if x.shape[-1] == 0:
        raise ValueError(f"row_sum needs a non-empty last dimension, got shape {tuple(x.shape)}")

    y = torch.empty(x.shape[:-1], dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    # A new contiguous float32 tensor, so the copy can treat both sides as flat arrays.
    sums = x.sum(dim=-1, dtype=torch.float32).contiguous()
    _copy_kernel[(triton.cdiv(y.numel(), BLOCK_SIZE),)](sums, y, y.numel(), BLOCK=BLOCK_SIZE)
    return y
