"""Tiled matrix multiplication with a fused GeLU epilogue, written in Triton."""

import torch
import triton
import triton.language as tl


def matmul(a: torch.Tensor, b: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """C = A @ B for 2-D A and B, computed by your own tiled Triton kernel, optionally followed by GeLU.

    For every i < M, j < N:
        c[i, j] = sum_{k < K} a[i, k] * b[k, j]                      (activation=None)
        c[i, j] = gelu(sum_{k < K} a[i, k] * b[k, j])                (activation="gelu")
        gelu(x) = 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))    (the tanh form, not the erf form)
    The library matrix products (`torch.mm`, `torch.matmul`, the `@` operator, `torch.nn.functional.linear`,
    `torch.einsum`, `torch.addmm`, `torch.bmm`, `torch.dot`, `torch.mv` and the like) must not be used.
    Beyond allocating, viewing and copying tensors, torch may not compute here (handout: "Do the work yourself").

    Args:
        a: shape (M, K), M >= 1, K >= 1.
        b: shape (K, N), N >= 1. Both 2-D only (no batch dims). Any M, N, K, however they fall against your block
            sizes (e.g. M = 129, N = 1, K = 1000): mask the edges. Any strides: transposed (`x.T`),
            sliced (`x[:, ::2]`) and offset views are valid inputs. Both float32, float16 or bfloat16,
            the same dtype for both. On the same device: a CUDA device, or the CPU when Triton's
            interpreter is on (TRITON_INTERPRET=1).
        activation: None, or "gelu" to apply GeLU (the tanh formula above) to the float32 accumulator inside the
            kernel, before the result is rounded and stored (a fused epilogue: no second pass over C). Either way a
            call launches exactly one Triton kernel.

    Returns:
        A new contiguous tensor c of shape (M, N), with the dtype and device of the inputs. Products are summed in a
        float32 accumulator whatever the input dtype, and rounded to the input dtype once, when c is stored.
        float32 inputs are computed in full float32 precision, on the GPU as on the interpreter: pass
        `input_precision="ieee"` to `tl.dot` for them. Triton's default for float32 on NVIDIA GPUs is TF32, which
        keeps 10 of the inputs' 23 mantissa bits: thousands of times the error the tolerance allows. The
        interpreter ignores the setting, so only a GPU run shows the difference.

    Raises (checked in this order, before any kernel is launched):
        TypeError: `a` or `b` is not a torch.Tensor, or its dtype is not float32, float16 or bfloat16, or the two
            dtypes differ.
        ValueError: `a` or `b` is not 2-D, a.shape[1] != b.shape[0], any of M, N, K is 0, the inputs are on
            different devices, or `activation` is neither None nor "gelu".

    Inputs containing inf or NaN, and outputs that overflow the output dtype, are outside this contract.
    """
    raise NotImplementedError
