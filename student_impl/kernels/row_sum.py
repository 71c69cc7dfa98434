"""Row sums (a sum over the last dimension), written in Triton."""

import torch
import triton
import triton.language as tl


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension of `x`, computed by your own Triton kernel(s).

    For every row r (all indices but the last) of x with n = x.shape[-1] columns:
        y[r] = sum_{j < n} x[r, j].
    The library sum (`torch.sum`, `Tensor.sum`) must not be used.
    Beyond allocating, viewing and copying tensors, torch may not compute here (handout: "Do the work yourself").

    Args:
        x: a tensor of shape (..., n) with ndim >= 1 and n >= 1. Any number of leading dims; any n, including
            rows far longer than one Triton block (e.g. n = 100_000: loop over the row in blocks, adding each
            block into the running sum, and mask the last, partial block). Any strides: non-contiguous views
            (transposed, sliced, starting at an offset) are valid inputs. dtype float32, float16 or bfloat16.
            On a CUDA device, or on the CPU when Triton's interpreter is on (TRITON_INTERPRET=1).

    Returns:
        A new contiguous tensor of shape x.shape[:-1] (the last dimension removed, not kept with size 1: a 1-D
        input gives a 0-d result) with the dtype and device of `x`. The sum is accumulated in float32 whatever
        the input dtype; it is cast to the input dtype once, at the end.
        A tensor with a leading dim of size 0 (and n >= 1) gives an empty output of shape x.shape[:-1].

    Raises (checked in this order, before any kernel is launched):
        TypeError: `x` is not a torch.Tensor, or its dtype is not float32, float16 or bfloat16 (a 0-d tensor of
            another dtype raises TypeError too).
        ValueError: `x` is 0-d, or its last dimension has length 0.

    Rows whose sum overflows the output dtype, and rows that contain inf or NaN, are outside this contract.
    """
    raise NotImplementedError
