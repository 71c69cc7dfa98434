"""Row sums (a sum over the last dimension), written in Triton.

Wrong on purpose: the sums are accumulated in float16 (to halve the registers a block needs), so
float32 inputs keep only 11 bits of precision.
"""

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Rows up to this many columns are loaded as one block; longer rows are streamed through blocks of this size.
BLOCK_COLS = 1024


@triton.jit
def _row_sum_short_kernel(x_ptr, y_ptr, n_cols, x_row_stride, x_col_stride, BLOCK: tl.constexpr):
    # One program per row, which fits in one block.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    # 0 in the padding adds nothing to the sum.
    x = tl.load(x_ptr + row * x_row_stride + cols * x_col_stride, mask=cols < n_cols, other=0.0)
    # Half precision halves the registers the block needs.
    total = tl.sum(x.to(tl.float16), axis=0)
    tl.store(y_ptr + row, total.to(y_ptr.dtype.element_ty))


@triton.jit
def _row_sum_long_kernel(x_ptr, y_ptr, n_cols, x_row_stride, x_col_stride, BLOCK: tl.constexpr):
    # One program per row, too long for one block: each block's sum is added to a running total.
    row = tl.program_id(0).to(tl.int64)
    x_row_ptr = x_ptr + row * x_row_stride
    cols = tl.arange(0, BLOCK)
    total = tl.zeros([], dtype=tl.float16)
    for start in range(0, n_cols, BLOCK):
        offsets = start + cols
        x = tl.load(x_row_ptr + offsets * x_col_stride, mask=offsets < n_cols, other=0.0)
        total += tl.sum(x.to(tl.float16), axis=0)
    tl.store(y_ptr + row, total.to(y_ptr.dtype.element_ty))


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

    n_cols = x.shape[-1]
    y = torch.empty(x.shape[:-1], dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    # Leading dims flattened into rows: a view when their strides allow, a copy otherwise. The kernels take both
    # strides, so sliced and transposed views are read in place.
    x_2d = x.reshape(-1, n_cols)
    n_rows = x_2d.shape[0]
    if n_cols <= BLOCK_COLS:
        _row_sum_short_kernel[(n_rows,)](
            x_2d, y, n_cols, x_2d.stride(0), x_2d.stride(1), BLOCK=triton.next_power_of_2(n_cols)
        )
    else:
        _row_sum_long_kernel[(n_rows,)](x_2d, y, n_cols, x_2d.stride(0), x_2d.stride(1), BLOCK=BLOCK_COLS)
    return y
