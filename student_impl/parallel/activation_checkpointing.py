"""Activation checkpointing: keep a block's inputs, not its internal activations, and recompute them in backward."""

from __future__ import annotations

import torch


def checkpoint(block: torch.nn.Module, *inputs: torch.Tensor):
    """Run `block(*inputs)` so that its internal activations are recomputed during backward instead of saved.

    Arguments:
      * `block`: any module whose forward takes the tensors `inputs` and returns a tensor or a tuple of tensors. It
        may contain dropout (or draw random numbers otherwise) and have parameters, some with `requires_grad=False`.
      * `inputs`: tensors on one device (CPU, or one CUDA device). Some, all or none require grad.

    Returns what `block(*inputs)` returns (the same values: bit for bit on the CPU), as new tensors whose autograd
    graph leads back to `inputs` and to the block's parameters. When grad mode is enabled and any input or any
    parameter of the block requires grad, every floating-point output requires grad, even if no input does (the
    first block of a network gets data that does not).

    Contract:
      * Forward runs `block` once, under `torch.no_grad()`. Between forward and backward the only tensors kept are
        references to `inputs` (not copies) and the random-number-generator states: none of the block's
        intermediate activations. The grader measures the bytes of every storage allocated during the call and still
        alive when it returns; apart from the outputs themselves they must stay below a quarter of what the plain
        `block(*inputs)` keeps alive for its backward.
      * Backward runs `block` again on the same inputs with grad enabled and backpropagates the output gradients
        through that recomputation. Gradients reach every input that requires grad and accumulate into `.grad` of
        every block parameter that requires grad, exactly as if `block(*inputs)` had been differentiated directly.
        An output whose gradient is None (unused by the loss) contributes nothing.
      * Random numbers replay: the recomputation draws the same random numbers as the forward did (same dropout
        masks), so gradients equal those of the plain block run from the same generator state. Save the CPU
        generator's state (`torch.get_rng_state()`) when forward starts and, if the inputs are on a GPU, that
        device's (`torch.cuda.get_rng_state(device)`). The recomputation must leave every generator as it found it:
        after backward, the next random numbers drawn are the ones that would be drawn without checkpointing.
      * The block is called once in forward and once in backward; `checkpoint` is called once per forward. A single
        backward through the outputs is supported (no `retain_graph` second backward, no double backward).
      * Do not use `torch.utils.checkpoint` (this problem reimplements it).
    """
    raise NotImplementedError
