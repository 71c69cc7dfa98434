"""RMSNorm over the last dimension, forward and backward, written in Triton."""

import torch
import triton
import triton.language as tl


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm as an autograd Function whose forward and backward each run your own Triton kernel(s).

    `rmsnorm` checks the arguments and calls `RMSNormFunction.apply(x, weight, eps)`; the grader calls `rmsnorm` and
    backpropagates through what it returns.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """y = x * rstd * weight for every row of x, by a Triton kernel (arguments already checked by `rmsnorm`).

        Saves for the backward x (or the contiguous copy of it that the kernel read), weight, and the per-row
        rstd = 1 / sqrt(mean(x^2) + eps) as a float32 tensor with one value per row; nothing else (not y, not
        x * rstd: those are as large as x).
        """
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        """(grad_x, grad_weight, None) from the upstream gradient grad_y (shape of x, dtype of x), by Triton kernel(s).

        With x_hat = x * rstd and gw = grad_y * weight, for each row:
            grad_x = rstd * (gw - x_hat * mean(gw * x_hat))           (the mean over the row's D elements)
            grad_weight = sum over all rows of grad_y * x_hat
        grad_x has x's shape and dtype; grad_weight has weight's shape (D,) and dtype; eps gets no gradient (None).
        All arithmetic in float32. grad_y may have any strides. grad_weight is a sum over every row: do not let all
        programs atomically add into the same D values (they would serialise on them); have each program sum its
        own rows into a float32 partial row, and reduce the [n_programs, D] partials afterwards with a second, small
        Triton kernel (a column sum): here, as in every Triton problem, torch may only allocate, view and copy.
        """
        raise NotImplementedError


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension of `x`, scaled by `weight`: returns `RMSNormFunction.apply(x, weight, eps)`.

    For every row r of x (all indices but the last) and column j < D = x.shape[-1]:
        rstd[r] = 1 / sqrt(mean_k x[r, k]^2 + eps)                  (eps INSIDE the square root)
        y[r, j] = x[r, j] * rstd[r] * weight[j]
    The mean square and rstd are computed in float32 whatever the input dtype, the products with rstd and with
    weight in float32 too, and y is rounded to x's dtype once, when it is stored. The library RMSNorm
    (`torch.nn.functional.rms_norm`, `torch.nn.RMSNorm`, aten's `rms_norm` and `_fused_rms_norm`) must not be
    used. Differentiable in x and weight (see `RMSNormFunction.backward`); the gradients are graded too.

    Args:
        x: a tensor of shape (..., D) with ndim >= 1 and D >= 1; any number of leading dims; dtype float32, float16
            or bfloat16. Any strides: rows need not be adjacent (a slice x_wide[..., :D] of a wider tensor), and
            the last dim need not be unit-stride (transposed or every-other-element views); copying such an x to
            contiguous first is allowed. On a CUDA device, or on the CPU when Triton's interpreter is on
            (TRITON_INTERPRET=1).
        weight: a tensor of shape (D,) with x's dtype and device; any stride.
        eps: a float (an int is accepted too), finite and > 0.

    Returns:
        A new contiguous tensor with the shape, dtype and device of x. A tensor with no rows (a leading dim of
        size 0) gives an empty output; its backward gives an empty grad_x and a zero grad_weight.

    Raises (checked in this order, before any kernel is launched):
        TypeError: x or weight is not a torch.Tensor; x's dtype is not float32, float16 or bfloat16; weight's dtype
            differs from x's; eps is not an int or a float (a bool is not accepted).
        ValueError: eps is not finite or not > 0; x is 0-d; x's last dimension has length 0; weight's shape is not
            (D,); weight is on another device than x.

    Rows that contain inf or NaN are outside this contract: any output is accepted for them.
    """
    raise NotImplementedError
