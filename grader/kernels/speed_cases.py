"""What the kernel problems' speed tests time: the inputs of each call and the baseline each kernel is timed
beside (torch's own operator), one SpeedSpec per problem (grader.speed.grading). Module-level functions: the student's
worker builds the same inputs by name."""

from __future__ import annotations

import torch

from grader.speed.grading import SpeedSpec
from grader.speed.timing import sample


def one_tensor(shape: tuple[int, ...], dtype: str, seed: int, device: torch.device) -> tuple[torch.Tensor]:
    """Inputs for a kernel of one tensor argument: standard normal values."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=generator, device=device, dtype=getattr(torch, dtype)),)


def torch_gelu_tanh(x):
    """torch's own GELU, tanh approximation."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def torch_softmax(x):
    """torch's own softmax over the last dimension."""
    return torch.softmax(x, dim=-1)


def torch_row_sum(x):
    """torch's own sum over the last dimension."""
    return x.sum(dim=-1)


def rmsnorm_inputs(shape: tuple[int, int], dtype: str, seed: int, device: torch.device):
    """x [rows, D] and weight [D] (forward only)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=generator, device=device, dtype=getattr(torch, dtype))
    return x, torch.rand(shape[-1], generator=generator, device=device, dtype=getattr(torch, dtype)) + 0.5


def torch_rms_norm(x, weight):
    """torch's own RMSNorm over the last dimension, eps 1e-6."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, 1e-6)


def matmul_inputs(shape: tuple[int, int, int], dtype: str, seed: int, device: torch.device):
    """A [M, K] and B [K, N] for shape (M, N, K)."""
    m, n, k = shape
    generator = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(m, k, generator=generator, device=device, dtype=getattr(torch, dtype))
    return a, torch.randn(k, n, generator=generator, device=device, dtype=getattr(torch, dtype))


def attention_inputs(shape: tuple[int, ...], dtype: str, seed: int, device: torch.device):
    """q, k, v of shape (batch, heads, seq, head_dim) and is_causal, for shape (batch, heads, seq, head_dim, causal)."""
    *size, causal = shape
    generator = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(size, generator=generator, device=device, dtype=getattr(torch, dtype)) for _ in range(3))
    return q, k, v, bool(causal)


def sdpa_flash(q, k, v, is_causal):
    """torch's own FlashAttention-2 kernel (the flash backend of scaled_dot_product_attention)."""
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def sampled_softmax(args: tuple, seed: int) -> torch.Tensor:
    """The true softmax at the positions grader.speed.timing.sample draws with `seed`, for a spec whose baseline is
    not a softmax."""
    return sample(torch.softmax(args[0].float(), dim=-1), seed)


SPEEDS = {
    "kernels.gelu": SpeedSpec("gelu", baseline=torch_gelu_tanh, inputs=one_tensor),
    "kernels.softmax": SpeedSpec("softmax", baseline=torch_softmax, inputs=one_tensor),
    "kernels.row_sum": SpeedSpec("row_sum", baseline=torch_row_sum, inputs=one_tensor),
    "kernels.rmsnorm": SpeedSpec("rmsnorm", baseline=torch_rms_norm, inputs=rmsnorm_inputs),
    "kernels.matmul": SpeedSpec("matmul", baseline=torch.matmul, inputs=matmul_inputs),
    "kernels.flash_attention_triton": SpeedSpec("flash_attention", baseline=sdpa_flash, inputs=attention_inputs),
}

# kernels.analysis: the student's softmax beside a copy of the same tensor, which moves the same bytes (one read and
# one write of every element), so the ratio of their times is the fraction of copy bandwidth the softmax reaches.
SOFTMAX_BESIDE_COPY = SpeedSpec("softmax", baseline=torch.clone, inputs=one_tensor, oracle=sampled_softmax)
