"""RMSNorm over the last dimension, forward and backward, written in Triton.

Wrong on purpose: eps is added to the root mean square instead of the mean square, rstd = 1 / (sqrt(mean(x^2)) + eps).
"""

import math

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Programs of the backward kernel: each sums dweight over its own rows into one partial row, and the partial rows
# are added up at the end.
BACKWARD_PROGRAMS = 8


@triton.jit
def _rmsnorm_forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, x_row_stride, eps, BLOCK: tl.constexpr):
    # One program per row, the whole row in one block: x read once, y written once.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / (tl.sqrt(tl.sum(x * x, axis=0) / n_cols) + eps)
    tl.store(rstd_ptr + row, rstd)
    y = x * rstd * w
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_backward_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols, rows_per_program, BLOCK: tl.constexpr
):
    # Program p handles rows [p * rows_per_program, (p + 1) * rows_per_program) of contiguous dy and x.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        offsets = row * n_cols + cols
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        wdy = w * dy
        # rstd depends on every x of the row: its derivative gives the projection term.
        c = tl.sum(x_hat * wdy, axis=0) / n_cols
        dx = (wdy - x_hat * c) * rstd
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=mask)


def _check_arguments(x, weight, eps) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("x and weight must be tensors")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {x.dtype}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight has dtype {weight.dtype}, x has {x.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be finite and positive, got {eps}")
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError("x and weight must be on the same device")


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        n_cols = x.shape[-1]
        x_2d = x.reshape(-1, n_cols)
        if x_2d.stride(-1) != 1:
            x_2d = x_2d.contiguous()
        weight = weight.contiguous()
        n_rows = x_2d.shape[0]
        y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        if n_rows > 0:
            _rmsnorm_forward_kernel[(n_rows,)](
                x_2d, weight, y, rstd, n_cols, x_2d.stride(0), eps, BLOCK=triton.next_power_of_2(n_cols)
            )
        ctx.save_for_backward(x_2d, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x_2d, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x_2d.shape
        # The backward kernel indexes rows as row * n_cols.
        x_2d = x_2d.contiguous()
        dy = grad_y.reshape(n_rows, n_cols).contiguous()
        dx = torch.empty_like(x_2d)
        n_programs = max(1, min(n_rows, BACKWARD_PROGRAMS))
        rows_per_program = triton.cdiv(n_rows, n_programs)
        dw_partial = torch.zeros((n_programs, n_cols), dtype=torch.float32, device=x_2d.device)
        if n_rows > 0:
            _rmsnorm_backward_kernel[(n_programs,)](
                dy, x_2d, weight, rstd, dx, dw_partial, n_rows, n_cols, rows_per_program,
                BLOCK=triton.next_power_of_2(n_cols),
            )
        return dx.view(grad_y.shape), dw_partial.sum(dim=0).to(weight.dtype), None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    _check_arguments(x, weight, eps)
    return RMSNormFunction.apply(x, weight, eps)
