"""RMSNorm over the last dimension in Triton, forward and backward, and the same math in plain PyTorch.

Forward: each program normalises whole rows, so a row's mean square never leaves the program; it writes y and the
row's rstd = 1 / sqrt(mean(x^2) + eps) (4 bytes a row, saved for the backward instead of y or x_hat).
Backward: for a row, dx = rstd * (g*w - x_hat * mean(g*w*x_hat)) with x_hat = x * rstd, which needs only that row;
dweight = sum over rows of g * x_hat needs every row. Each program owns a contiguous range of rows, sums its
rows' g * x_hat in registers and writes one fp32 partial row; a second small kernel sums the [n_programs, D]
partials by column into dweight. No atomics: n_programs is a few per SM, so the partials cost a few percent of the
traffic of reading g and x and writing dx.
"""

import math

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Longest row held in registers whole (a power of two). The backward holds x, g, w and the dweight sum for a row
# block, so 8192 columns at 16 warps is 4 x 16 fp32 values a thread; longer rows are streamed in blocks of this size.
MAX_FUSED_COLS = 8192
# The forward holds only x and w: whole rows up to 32768 columns stay in registers (64 fp32 values a thread at 16
# warps), so x is read once instead of twice; on an H200 at 4096x32768 this moved fp32 from 2.8 to 3.9 TB/s. Under
# the interpreter the backward's limit applies to both, so that CPU tests still reach the streaming forward kernel.
MAX_FUSED_FORWARD_COLS = MAX_FUSED_COLS if triton.knobs.runtime.interpret else 32768
# Elements one fused program handles at a time: short rows are packed several to a block so that each program
# still moves enough bytes to hide its load latency.
ELEMENTS_PER_BLOCK = 4096
ELEMENTS_PER_THREAD = 16
MAX_NUM_WARPS = 16
# Backward programs per SM: enough to fill the GPU, few enough that the partial dweight rows stay small.
BACKWARD_PROGRAMS_PER_SM = 2
# Under Triton's interpreter programs run one after another; a few still exercise the reduction across programs.
INTERPRETER_BACKWARD_PROGRAMS = 4
# The partials' column sum: 32 partial rows x 128 columns a step (16 fp32 values a thread at 4 warps).
SUM_BLOCK_PARTIALS = 32
SUM_BLOCK_COLS = 128


def _check_arguments(x, weight, eps, allowed_dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"rmsnorm expects x to be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"rmsnorm expects weight to be a torch.Tensor, got {type(weight).__name__}")
    if x.dtype not in allowed_dtypes:
        raise TypeError(f"rmsnorm supports dtypes {allowed_dtypes}, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be finite and > 0, got {eps}")
    if x.ndim == 0:
        raise ValueError("rmsnorm needs x with at least one dimension, got a 0-d tensor")
    if x.shape[-1] == 0:
        raise ValueError(f"rmsnorm needs a last dimension of length >= 1, got shape {tuple(x.shape)}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")


@triton.jit
def _rmsnorm_forward_kernel(
    x_ptr,
    weight_ptr,
    y_ptr,
    rstd_ptr,
    n_rows,
    n_cols,
    x_row_stride,
    weight_stride,
    eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # Traffic: x read once, y written once, plus one weight row a program and 4 bytes of rstd a row.
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    # Zero padding adds nothing to the sum of squares; padding rows get rstd = 1/sqrt(eps), finite and never stored.
    x_RC = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    weight_C = tl.load(weight_ptr + cols * weight_stride, mask=col_mask, other=0.0).to(tl.float32)
    rstd_R = tl.rsqrt(tl.sum(x_RC * x_RC, axis=1) / n_cols + eps)
    y_RC = x_RC * rstd_R[:, None] * weight_C[None, :]
    tl.store(y_ptr + rows64[:, None] * n_cols + cols[None, :], y_RC.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd_R, mask=row_mask)


@triton.jit
def _rmsnorm_forward_long_rows_kernel(
    x_ptr,
    weight_ptr,
    y_ptr,
    rstd_ptr,
    n_cols,
    x_row_stride,
    weight_stride,
    eps,
    BLOCK_COLS: tl.constexpr,
):
    # Traffic: x read twice (the second pass mostly from L2), y written once.
    row = tl.program_id(0).to(tl.int64)
    x_row_ptr = x_ptr + row * x_row_stride
    y_row_ptr = y_ptr + row * n_cols
    cols = tl.arange(0, BLOCK_COLS)
    # Per-lane partial sums, reduced once after the loop.
    sum_squares = tl.zeros([BLOCK_COLS], tl.float32)
    for block_start in range(0, n_cols, BLOCK_COLS):
        offsets = block_start + cols
        x = tl.load(x_row_ptr + offsets, mask=offsets < n_cols, other=0.0).to(tl.float32)
        sum_squares += x * x
    rstd = tl.rsqrt(tl.sum(sum_squares, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    for block_start in range(0, n_cols, BLOCK_COLS):
        offsets = block_start + cols
        mask = offsets < n_cols
        x = tl.load(x_row_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        weight = tl.load(weight_ptr + offsets * weight_stride, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row_ptr + offsets, (x * rstd * weight).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_backward_kernel(
    grad_y_ptr,
    x_ptr,
    weight_ptr,
    rstd_ptr,
    grad_x_ptr,
    partial_grad_weight_ptr,
    n_rows,
    n_cols,
    grad_y_row_stride,
    x_row_stride,
    weight_stride,
    rows_per_program,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # Traffic: g and x read once, dx written once; one weight row read and one fp32 partial row written a program.
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    weight_C = tl.load(weight_ptr + cols * weight_stride, mask=col_mask, other=0.0).to(tl.float32)
    grad_weight_C = tl.zeros([BLOCK_COLS], tl.float32)
    first_row = program * rows_per_program
    end_row = tl.minimum(first_row + rows_per_program, n_rows)
    for block_start in range(first_row, end_row, BLOCK_ROWS):
        rows = block_start + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < end_row
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        # Zeros in the padding: they add nothing to either sum, and their dx is never stored.
        grad_y_RC = tl.load(
            grad_y_ptr + rows64[:, None] * grad_y_row_stride + cols[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        x_RC = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd_R = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        x_hat_RC = x_RC * rstd_R[:, None]
        grad_x_hat_RC = grad_y_RC * weight_C[None, :]
        # d rstd / d x_j = -rstd^3 x_j / n: the term every element of the row receives through the mean square.
        projection_R = tl.sum(grad_x_hat_RC * x_hat_RC, axis=1) / n_cols
        grad_x_RC = (grad_x_hat_RC - x_hat_RC * projection_R[:, None]) * rstd_R[:, None]
        tl.store(
            grad_x_ptr + rows64[:, None] * n_cols + cols[None, :], grad_x_RC.to(grad_x_ptr.dtype.element_ty), mask=mask
        )
        grad_weight_C += tl.sum(grad_y_RC * x_hat_RC, axis=0)
    tl.store(partial_grad_weight_ptr + program.to(tl.int64) * n_cols + cols, grad_weight_C, mask=col_mask)


@triton.jit
def _rmsnorm_backward_long_rows_kernel(
    grad_y_ptr,
    x_ptr,
    weight_ptr,
    rstd_ptr,
    grad_x_ptr,
    partial_grad_weight_ptr,
    n_rows,
    n_cols,
    grad_y_row_stride,
    x_row_stride,
    weight_stride,
    rows_per_program,
    BLOCK_COLS: tl.constexpr,
):
    # A row too long for registers is read twice: once for its projection, once for dx. The program's partial
    # dweight row (zeroed by the caller) is updated in memory; only this program touches it, so it stays in L2.
    program = tl.program_id(0)
    partial_row_ptr = partial_grad_weight_ptr + program.to(tl.int64) * n_cols
    cols = tl.arange(0, BLOCK_COLS)
    # int64 rows: row * stride can pass 2^31 on large tensors.
    first_row = program.to(tl.int64) * rows_per_program
    end_row = tl.minimum(first_row + rows_per_program, n_rows)
    for row in range(first_row, end_row):
        grad_y_row_ptr = grad_y_ptr + row * grad_y_row_stride
        x_row_ptr = x_ptr + row * x_row_stride
        grad_x_row_ptr = grad_x_ptr + row * n_cols
        rstd = tl.load(rstd_ptr + row)
        products = tl.zeros([BLOCK_COLS], tl.float32)
        for block_start in range(0, n_cols, BLOCK_COLS):
            offsets = block_start + cols
            mask = offsets < n_cols
            grad_y = tl.load(grad_y_row_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_row_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            weight = tl.load(weight_ptr + offsets * weight_stride, mask=mask, other=0.0).to(tl.float32)
            products += grad_y * weight * x
        projection = tl.sum(products, axis=0) * rstd / n_cols
        for block_start in range(0, n_cols, BLOCK_COLS):
            offsets = block_start + cols
            mask = offsets < n_cols
            grad_y = tl.load(grad_y_row_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            x_hat = tl.load(x_row_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * rstd
            weight = tl.load(weight_ptr + offsets * weight_stride, mask=mask, other=0.0).to(tl.float32)
            grad_x = (grad_y * weight - x_hat * projection) * rstd
            tl.store(grad_x_row_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)
            partial = tl.load(partial_row_ptr + offsets, mask=mask, other=0.0)
            tl.store(partial_row_ptr + offsets, partial + grad_y * x_hat, mask=mask)


@triton.jit
def _sum_partials_kernel(
    partial_ptr,  # [n_partials, n_cols] float32, contiguous
    grad_weight_ptr,  # [n_cols] in weight's dtype
    n_partials,
    n_cols,
    BLOCK_PARTIALS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # One program per block of columns reads its [n_partials, BLOCK_COLS] slab once and rounds once at the store.
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    total = tl.zeros([BLOCK_COLS], tl.float32)
    for start in range(0, n_partials, BLOCK_PARTIALS):
        rows = start + tl.arange(0, BLOCK_PARTIALS)
        mask = (rows[:, None] < n_partials) & col_mask[None, :]
        total += tl.sum(tl.load(partial_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0), axis=0)
    tl.store(grad_weight_ptr + cols, total.to(grad_weight_ptr.dtype.element_ty), mask=col_mask)


def _sum_partials(partial_grad_weight_PD: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n_partials, n_cols = partial_grad_weight_PD.shape
    grad_weight_D = torch.empty(n_cols, dtype=dtype, device=partial_grad_weight_PD.device)
    block_cols = min(triton.next_power_of_2(n_cols), SUM_BLOCK_COLS)
    _sum_partials_kernel[(triton.cdiv(n_cols, block_cols),)](
        partial_grad_weight_PD, grad_weight_D, n_partials, n_cols,
        BLOCK_PARTIALS=min(triton.next_power_of_2(n_partials), SUM_BLOCK_PARTIALS), BLOCK_COLS=block_cols,
    )
    return grad_weight_D


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, n_cols] with unit column stride: a view whenever the leading dims collapse to one row stride."""
    n_cols = t.shape[-1]
    # A non-unit column stride would turn every load into a gather; one copy to contiguous is cheaper.
    if n_cols > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, n_cols)


def _block_shape(n_rows: int, n_cols: int, max_fused_cols: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_COLS, num_warps) of the fused kernels; rows longer than max_fused_cols are streamed in
    blocks of max_fused_cols."""
    block_cols = triton.next_power_of_2(n_cols)
    if block_cols > max_fused_cols:
        return 1, max_fused_cols, MAX_NUM_WARPS
    block_rows = min(max(1, ELEMENTS_PER_BLOCK // block_cols), triton.next_power_of_2(n_rows))
    num_warps = min(MAX_NUM_WARPS, max(1, block_rows * block_cols // (32 * ELEMENTS_PER_THREAD)))
    return block_rows, block_cols, num_warps


def _rmsnorm_forward(x_2d: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    n_rows, n_cols = x_2d.shape
    y_2d = torch.empty((n_rows, n_cols), dtype=x_2d.dtype, device=x_2d.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x_2d.device)
    if n_rows == 0:
        return y_2d, rstd
    block_rows, block_cols, num_warps = _block_shape(n_rows, n_cols, MAX_FUSED_FORWARD_COLS)
    if triton.next_power_of_2(n_cols) <= MAX_FUSED_FORWARD_COLS:
        _rmsnorm_forward_kernel[(triton.cdiv(n_rows, block_rows),)](
            x_2d, weight, y_2d, rstd, n_rows, n_cols, x_2d.stride(0), weight.stride(0), eps,
            BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps,
        )
    else:
        _rmsnorm_forward_long_rows_kernel[(n_rows,)](
            x_2d, weight, y_2d, rstd, n_cols, x_2d.stride(0), weight.stride(0), eps,
            BLOCK_COLS=block_cols, num_warps=num_warps,
        )
    return y_2d, rstd


def _max_backward_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return BACKWARD_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_BACKWARD_PROGRAMS


def _rmsnorm_backward(
    grad_y_2d: torch.Tensor, x_2d: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    n_rows, n_cols = x_2d.shape
    grad_x_2d = torch.empty((n_rows, n_cols), dtype=x_2d.dtype, device=x_2d.device)
    if n_rows == 0:
        return grad_x_2d, torch.zeros(n_cols, dtype=weight.dtype, device=weight.device)
    block_rows, block_cols, num_warps = _block_shape(n_rows, n_cols, MAX_FUSED_COLS)
    # Whole row blocks to each program, spread evenly: the last program may get fewer.
    n_row_blocks = triton.cdiv(n_rows, block_rows)
    blocks_per_program = triton.cdiv(n_row_blocks, min(n_row_blocks, _max_backward_programs(x_2d.device)))
    n_programs = triton.cdiv(n_row_blocks, blocks_per_program)
    rows_per_program = blocks_per_program * block_rows
    common = (n_rows, n_cols, grad_y_2d.stride(0), x_2d.stride(0), weight.stride(0), rows_per_program)
    if triton.next_power_of_2(n_cols) <= MAX_FUSED_COLS:
        partial_grad_weight_PD = torch.empty((n_programs, n_cols), dtype=torch.float32, device=x_2d.device)
        _rmsnorm_backward_kernel[(n_programs,)](
            grad_y_2d, x_2d, weight, rstd, grad_x_2d, partial_grad_weight_PD, *common,
            BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps,
        )
    else:
        partial_grad_weight_PD = torch.zeros((n_programs, n_cols), dtype=torch.float32, device=x_2d.device)
        _rmsnorm_backward_long_rows_kernel[(n_programs,)](
            grad_y_2d, x_2d, weight, rstd, grad_x_2d, partial_grad_weight_PD, *common,
            BLOCK_COLS=block_cols, num_warps=num_warps,
        )
    return grad_x_2d, _sum_partials(partial_grad_weight_PD, weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm over the last dimension with Triton kernels for the forward and the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x_2d = _as_rows(x)
        y_2d, rstd = _rmsnorm_forward(x_2d, weight, eps)
        # rstd is 4 bytes a row; x_hat or y would be a second copy of x.
        ctx.save_for_backward(x_2d, weight, rstd)
        return y_2d.view(x.shape)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x_2d, weight, rstd = ctx.saved_tensors
        grad_x_2d, grad_weight = _rmsnorm_backward(_as_rows(grad_y), x_2d, weight, rstd)
        return grad_x_2d.view(grad_y.shape), grad_weight, None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of `x` over its last dimension, scaled by `weight`; differentiable in x and weight."""
    _check_arguments(x, weight, eps, SUPPORTED_DTYPES)
    return RMSNormFunction.apply(x, weight, eps)


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The same RMSNorm in plain PyTorch, computed in x's own dtype (float64 too), with the same argument checks."""
    _check_arguments(x, weight, eps, SUPPORTED_DTYPES + (torch.float64,))
    rstd = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    return (x * rstd * weight).contiguous()
