"""Sum over the last dimension in Triton, and the same sum in plain PyTorch.

Each program owns a tile of whole rows and walks across them one block of columns at a time, adding every block
into a float32 accumulator of the tile's shape; the lanes are reduced once, after the last block. Each element is
read once and the output is n times smaller than the input, so the kernel moves about one element of traffic per
element, and short rows are packed several to a program so that every program still streams enough bytes.
Parallelism comes from rows only: a few very long rows keep only a few SMs busy, which splitting rows across
programs would fix at the price of a second pass or of atomics (and an order of addition that varies by run).
"""

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Widest block of columns: 4096 fp32 accumulators are 16 per thread at 8 warps; longer rows loop over blocks.
MAX_BLOCK_COLS = 4096
# Elements of one tile (rows x columns): short rows are packed until a tile holds this many.
ELEMENTS_PER_TILE = 4096
NUM_WARPS = 8


def _check_arguments(x: torch.Tensor, allowed_dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"row_sum expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in allowed_dtypes:
        raise TypeError(f"row_sum supports dtypes {allowed_dtypes}, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("row_sum needs a tensor with at least one dimension, got a 0-d tensor")
    if x.shape[-1] == 0:
        raise ValueError(f"row_sum needs a last dimension of length >= 1, got shape {tuple(x.shape)}")


@triton.jit
def _row_sum_kernel(
    x_ptr,
    y_ptr,
    n_rows,
    n_cols,
    x_row_stride,
    x_col_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows
    # int64: rows * row_stride passes 2**31 on large tensors.
    row_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    # One accumulator per lane: each adds n_cols / BLOCK_COLS elements, and the tree reduction at the end adds
    # the lanes, so no partial sum ever absorbs many small terms one at a time.
    acc_RC = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for col_start in range(0, n_cols, BLOCK_COLS):
        col_offsets = col_start + cols
        mask = row_mask[:, None] & (col_offsets[None, :] < n_cols)
        # 0 in the padding adds nothing to the sum.
        x_RC = tl.load(row_ptrs + col_offsets[None, :] * x_col_stride, mask=mask, other=0.0)
        acc_RC += x_RC.to(tl.float32)
    sums_R = tl.sum(acc_RC, axis=1)
    tl.store(y_ptr + rows, sums_R.to(y_ptr.dtype.element_ty), mask=row_mask)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension of `x` (any leading shape, float32/float16/bfloat16), accumulated in fp32."""
    _check_arguments(x, SUPPORTED_DTYPES)
    y = torch.empty(x.shape[:-1], dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    n_cols = x.shape[-1]
    # A view whenever the leading dims collapse to one row stride (contiguous tensors, sliced rows, 2-d
    # transposes), a copy otherwise. Both strides go to the kernel, so views are read in place; Triton specialises
    # a stride of 1, so contiguous rows still load as wide vectors.
    x_2d = x.reshape(-1, n_cols)
    n_rows = x_2d.shape[0]
    block_cols = min(triton.next_power_of_2(n_cols), MAX_BLOCK_COLS)
    block_rows = min(ELEMENTS_PER_TILE // block_cols, triton.next_power_of_2(n_rows))
    _row_sum_kernel[(triton.cdiv(n_rows, block_rows),)](
        x_2d,
        y,
        n_rows,
        n_cols,
        x_2d.stride(0),
        x_2d.stride(1),
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        num_warps=NUM_WARPS,
    )
    return y


def row_sum_torch(x: torch.Tensor) -> torch.Tensor:
    """The same sum in plain PyTorch, computed in x's own dtype (float64 too), with the same argument checks."""
    _check_arguments(x, SUPPORTED_DTYPES + (torch.float64,))
    return x.sum(dim=-1).contiguous()
