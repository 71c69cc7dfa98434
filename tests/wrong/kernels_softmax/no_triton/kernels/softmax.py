"""Softmax over the last dimension.

Wrong on purpose: plain PyTorch math, with no Triton kernel at all.
"""

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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

    x32 = x.float()
    # Subtracting the row max keeps exp from overflowing for large inputs.
    numerators = torch.exp(x32 - x32.amax(dim=-1, keepdim=True))
    y = numerators / numerators.sum(dim=-1, keepdim=True)
    return y.to(x.dtype).contiguous()
