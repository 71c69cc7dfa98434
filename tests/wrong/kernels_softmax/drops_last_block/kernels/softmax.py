"""Softmax over the last dimension, written in Triton.

Wrong on purpose: pass 1 of the long-row kernel visits only the full blocks, so the partial block at the end of the
row is left out of the max and the sum.
"""

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Rows up to this many columns are loaded as one block; longer rows are streamed through blocks of this size.
BLOCK_COLS = 2048


@triton.jit
def _softmax_row_kernel(x_ptr, y_ptr, n_cols, x_row_stride, x_col_stride, BLOCK: tl.constexpr):
    # One program per row, which fits in one block: read once, written once.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # -inf padding never wins the max and adds exp(-inf) = 0 to the sum.
    x = tl.load(x_ptr + row * x_row_stride + cols * x_col_stride, mask=mask, other=-float("inf")).to(tl.float32)
    numerators = tl.exp(x - tl.max(x, axis=0))
    y = numerators / tl.sum(numerators, axis=0)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_long_row_kernel(x_ptr, y_ptr, n_cols, x_row_stride, x_col_stride, BLOCK: tl.constexpr):
    # One program per row, too long for one block. Pass 1 reads the row once for its max and sum, pass 2 reads it
    # again and writes the output: 3 elements of traffic per element.
    row = tl.program_id(0).to(tl.int64)
    x_row_ptr = x_ptr + row * x_row_stride
    y_row_ptr = y_ptr + row * n_cols
    cols = tl.arange(0, BLOCK)

    # Online max and sum: when a block raises the max, the sum so far is rescaled by exp(old_max - new_max).
    row_max = tl.full([], -float("inf"), tl.float32)
    row_sum = tl.zeros([], tl.float32)
    # Full blocks only, so these loads need no mask.
    for start in range(0, n_cols - BLOCK + 1, BLOCK):
        offsets = start + cols
        x = tl.load(x_row_ptr + offsets * x_col_stride).to(tl.float32)
        # Every block holds at least one real element, so new_max is finite and exp(-inf - new_max) = 0 at the start.
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        row_sum = row_sum * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        row_max = new_max

    for start in range(0, n_cols, BLOCK):
        offsets = start + cols
        mask = offsets < n_cols
        x = tl.load(x_row_ptr + offsets * x_col_stride, mask=mask, other=-float("inf")).to(tl.float32)
        y = tl.exp(x - row_max) / row_sum
        tl.store(y_row_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension of `x`, with the max, exponentials and sum in float32."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"softmax expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"softmax supports float32, float16 and bfloat16, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("softmax needs at least one dimension")
    if x.shape[-1] == 0:
        raise ValueError(f"softmax needs a non-empty last dimension, got shape {tuple(x.shape)}")

    n_cols = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    # Leading dims flattened into rows: a view when their strides allow, a copy otherwise. The kernels take both
    # strides, so sliced and transposed views are read in place.
    x_2d = x.reshape(-1, n_cols)
    n_rows = x_2d.shape[0]
    if n_cols <= BLOCK_COLS:
        _softmax_row_kernel[(n_rows,)](
            x_2d, y, n_cols, x_2d.stride(0), x_2d.stride(1), BLOCK=triton.next_power_of_2(n_cols)
        )
    else:
        _softmax_long_row_kernel[(n_rows,)](x_2d, y, n_cols, x_2d.stride(0), x_2d.stride(1), BLOCK=BLOCK_COLS)
    return y
