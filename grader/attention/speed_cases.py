"""What the attention family's speed tests time: the sliding window's, the sparse attention's or the chunked form's
forward and backward at a training shape, beside torch's FlashAttention-2 (causal, forward and backward) on the same
q, k, v, and the oracle the students' copy checks a timed output against (grader.speed.grading). Module-level
functions: the student's worker builds the same inputs by name."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grader.attention.dsa_cases import causal_topk
from grader.attention.linear_cases import GATED_DELTANET, LINEAR_ATTENTION, MAMBA2, Recurrence, recurrence_stepwise
from grader.speed.grading import SpeedSpec
from grader.speed.timing import sample_positions


def _inputs(recurrence: Recurrence, shape: tuple[int, ...], dtype: str, seed: int, device: torch.device) -> tuple:
    """q, k, v (and g, beta) requiring gradients, then the upstream gradients of o (and of the final state)."""
    batch, heads, seq, head_dim = shape
    generator = torch.Generator(device=device).manual_seed(seed)
    torch_dtype = getattr(torch, dtype)

    def normal(*size, dtype=torch_dtype):
        return torch.randn(size, generator=generator, device=device, dtype=dtype)

    q, k, v = (normal(batch, heads, seq, head_dim) for _ in range(3))
    if recurrence.problem == "gated_deltanet":
        k = F.normalize(k.float(), dim=-1).to(torch_dtype)
    if recurrence.problem != "linear_attention":
        q = q * head_dim**-0.5
    tensors = [q, k, v]
    if "g" in recurrence.gates:
        tensors.append(-F.softplus(normal(batch, heads, seq, dtype=torch.float32)) * 0.1)
    if "beta" in recurrence.gates:
        tensors.append(torch.sigmoid(normal(batch, heads, seq, dtype=torch.float32)))
    tensors = [t.requires_grad_(True) for t in tensors]
    upstream = [normal(batch, heads, seq, head_dim)]
    if recurrence.has_state:
        upstream.append(normal(batch, heads, head_dim, head_dim, dtype=torch.float32))
    return (*tensors, *upstream)


def linear_attention_inputs(shape, dtype, seed, device):
    return _inputs(LINEAR_ATTENTION, shape, dtype, seed, device)


def mamba2_inputs(shape, dtype, seed, device):
    return _inputs(MAMBA2, shape, dtype, seed, device)


def gated_deltanet_inputs(shape, dtype, seed, device):
    return _inputs(GATED_DELTANET, shape, dtype, seed, device)


def _split(args: tuple) -> tuple[list, list]:
    """(the tensors of the call, the upstream gradients) of an inputs tuple: the upstream ones need no gradient."""
    inputs = [a for a in args if a.requires_grad]
    return inputs, [a for a in args if not a.requires_grad]


def forward_backward(function, *args) -> torch.Tensor:
    """The timed call: the forward, then the backward to every input. The backward may compute in torch (the
    contract allows a chunked PyTorch backward), so only the forward is held to the allowlist of the rules."""
    from grader.sandbox.guards import torch_compute_allowed

    inputs, upstream = _split(args)
    result = function(*inputs)
    outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    with torch_compute_allowed():
        torch.autograd.backward(outputs, upstream[:len(outputs)])
    return outputs[0].detach()


def flash_attention_causal(q, k, v, *rest):
    """torch's FlashAttention-2 kernel (the flash backend of scaled_dot_product_attention), causal, on q, k, v."""
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _sampled(recurrence: Recurrence):
    """The oracle of a recurrence's timed output at the positions grader.speed.timing.sample draws with `seed`: the
    recurrence step by step in float32 on the device (float64 would take minutes there), sampled."""

    @torch.no_grad()
    def oracle(args: tuple, seed: int) -> torch.Tensor:
        inputs, _ = _split(args)
        output, _ = recurrence_stepwise(recurrence, *(t.detach().float() for t in inputs))
        flat = output.reshape(-1)
        return flat[sample_positions(flat.numel(), seed).to(flat.device)].to("cpu", torch.float64)

    oracle.__name__ = oracle.__qualname__ = f"sampled_{recurrence.problem}"
    return oracle


def sliding_window_inputs(shape: tuple[int, ...], dtype: str, seed: int, device: torch.device) -> tuple:
    """q, k, v requiring gradients, the window, and dO, for shape (batch, heads, seq, head_dim, window)."""
    *size, window = shape
    generator = torch.Generator(device=device).manual_seed(seed)
    q, k, v, grad_o = (torch.randn(size, generator=generator, device=device, dtype=getattr(torch, dtype))
                       for _ in range(4))
    return q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True), window, grad_o


def window_forward_backward(function, q, k, v, window, grad_o) -> torch.Tensor:
    """The timed call of the sliding-window problem: the forward, then the gradients of q, k and v."""
    from grader.sandbox.guards import torch_compute_allowed

    output = function(q, k, v, window)
    with torch_compute_allowed():  # autograd's own bookkeeping; the probe tests hold the backward to Triton
        torch.autograd.grad(output, (q, k, v), grad_o)
    return output.detach()


@torch.no_grad()
def sampled_sliding_window(args: tuple, seed: int) -> torch.Tensor:
    """The window's true output at the sampled positions, each from its own query row in float32 on the device."""
    q, k, v, window, _ = args
    batch, heads, seq, head_dim = q.shape
    positions = sample_positions(q.numel(), seed)
    values = []
    for position in positions.tolist():
        row, column = divmod(position, head_dim)
        pair, query = divmod(row, seq)
        b, h = divmod(pair, heads)
        start = max(0, query - window + 1)
        keys, vals = k[b, h, start:query + 1].float(), v[b, h, start:query + 1].float()
        weights = torch.softmax(keys @ q[b, h, query].float() / head_dim**0.5, dim=0)
        values.append(weights @ vals[:, column])
    return torch.stack(values).to("cpu", torch.float64)


def sparse_attention_inputs(shape: tuple[int, ...], dtype: str, seed: int, device: torch.device) -> tuple:
    """q, k, v requiring gradients, each query's top-k of random scores, and dO, for shape
    (batch, seq, heads, head_dim, topk)."""
    batch, seq, heads, head_dim, topk = shape
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*size):
        return torch.randn(size, generator=generator, device=device, dtype=getattr(torch, dtype))

    q, k, v = normal(batch, seq, heads, head_dim), normal(batch, seq, head_dim), normal(batch, seq, head_dim)
    indices = causal_topk(torch.rand(batch, seq, seq, generator=generator, device=device), topk)
    return (q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True), indices,
            normal(batch, seq, heads, head_dim))


def sparse_forward_backward(function, q, k, v, indices, grad_o) -> torch.Tensor:
    """The timed call of the sparse attention problem: the forward, then the gradients of q, k and v."""
    from grader.sandbox.guards import torch_compute_allowed

    output = function(q, k, v, indices)
    with torch_compute_allowed():  # autograd's own bookkeeping; the probe tests hold the backward to Triton
        torch.autograd.grad(output, (q, k, v), grad_o)
    return output.detach()


def dense_causal_flash(q, k, v, indices):
    """torch's FlashAttention-2, causal over every key, on the sparse problem's tensors (k and v repeated per head)."""
    heads = q.shape[2]
    q, k, v = q.transpose(1, 2), *(t[:, None].expand(-1, heads, -1, -1).contiguous() for t in (k, v))
    return flash_attention_causal(q, k, v).transpose(1, 2)


@torch.no_grad()
def sampled_sparse_attention(args: tuple, seed: int) -> torch.Tensor:
    """The true output at the sampled positions, each from its query's selected keys in float32 on the device."""
    q, k, v, indices, _ = args
    batch, seq, heads, head_dim = q.shape
    values = []
    for position in sample_positions(q.numel(), seed).tolist():
        row, column = divmod(position, head_dim)
        token, head = divmod(row, heads)
        b, t = divmod(token, seq)
        keys = indices[b, t][indices[b, t] >= 0]
        weights = torch.softmax(k[b, keys].float() @ q[b, t, head].float() / head_dim**0.5, dim=0)
        values.append(weights @ v[b, keys, column].float())
    return torch.stack(values).to("cpu", torch.float64)


SPEEDS = {
    "attention.sliding_window": SpeedSpec("sliding_window_attention", baseline=flash_attention_causal,
                                          inputs=sliding_window_inputs, harness=window_forward_backward,
                                          oracle=sampled_sliding_window),
    "attention.sparse_dsa": SpeedSpec("sparse_attention", baseline=dense_causal_flash, inputs=sparse_attention_inputs,
                                      harness=sparse_forward_backward, oracle=sampled_sparse_attention),
    "attention.linear_attention": SpeedSpec("linear_attention_chunked", baseline=flash_attention_causal,
                                            inputs=linear_attention_inputs, harness=forward_backward,
                                            oracle=_sampled(LINEAR_ATTENTION)),
    "attention.mamba2": SpeedSpec("mamba2_chunked", baseline=flash_attention_causal, inputs=mamba2_inputs,
                                  harness=forward_backward, oracle=_sampled(MAMBA2)),
    "attention.gated_deltanet": SpeedSpec("gated_deltanet_chunked", baseline=flash_attention_causal,
                                          inputs=gated_deltanet_inputs, harness=forward_backward,
                                          oracle=_sampled(GATED_DELTANET)),
}
