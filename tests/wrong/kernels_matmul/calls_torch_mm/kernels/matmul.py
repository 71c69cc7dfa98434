"""Tiled matrix multiplication with a fused GeLU epilogue, written in Triton.

Wrong on purpose: the product comes from torch's `@` (aten.mm) in float32; only the GeLU and the rounding to the
input dtype run in Triton.
"""

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK = 1024


@triton.jit
def _epilogue_kernel(acc_ptr, c_ptr, n_elements, APPLY_GELU: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.load(acc_ptr + offsets, mask=mask, other=0.0)
    if APPLY_GELU:
        # tanh(u) = 2 sigmoid(2u) - 1, so 0.5 x (1 + tanh(u)) = x sigmoid(2u).
        x = x * tl.sigmoid(2.0 * 0.7978845608028654 * (x + 0.044715 * x * x * x))
    tl.store(c_ptr + offsets, x.to(c_ptr.dtype.element_ty), mask=mask)


def matmul(a: torch.Tensor, b: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """C = A @ B with a float32 accumulator, optionally followed by the tanh GeLU, rounded once to the input dtype."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError("matmul expects two torch.Tensor inputs")
    if a.dtype not in SUPPORTED_DTYPES or b.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"matmul supports float32, float16 and bfloat16, got {a.dtype} and {b.dtype}")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"matmul takes 2-D inputs, got {a.ndim}-D and {b.ndim}-D")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.numel() == 0 or b.numel() == 0:
        raise ValueError("matmul needs M, N, K >= 1")
    if a.device != b.device:
        raise ValueError("a and b must be on the same device")
    if activation not in (None, "gelu"):
        raise ValueError(f"unknown activation {activation!r}")

    acc = (a.float() @ b.float()).contiguous()
    c = torch.empty(acc.shape, dtype=a.dtype, device=a.device)
    n_elements = acc.numel()
    _epilogue_kernel[(triton.cdiv(n_elements, BLOCK),)](
        acc, c, n_elements, APPLY_GELU=activation == "gelu", BLOCK=BLOCK
    )
    return c
