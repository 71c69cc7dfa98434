"""Memory and communication accounting for data, ZeRO, tensor and sequence parallelism, as closed-form formulas.

Pure functions: no ranks, no tensors. Arguments are Python ints (and a str or bool where stated); invalid
arguments raise ValueError (a bool is not an accepted integer).
"""

from __future__ import annotations

from typing import NamedTuple


class BytesPerParameter(NamedTuple):
    """Bytes one rank holds per parameter of the model."""

    parameters: float
    gradients: float
    optimizer_state: float
    total: float  # parameters + gradients + optimizer_state


class ActivationBytes(NamedTuple):
    """Bytes of activations one rank stores for the backward of one transformer layer."""

    attention: int
    mlp: int
    layernorm: int
    total: int  # attention + mlp + layernorm


def bytes_per_parameter(strategy: str, world_size: int) -> BytesPerParameter:
    """Model-state memory per parameter on each of `world_size` = N data-parallel ranks, training with
    mixed-precision Adam.

    Per parameter the model state is 2 bytes of bf16 parameter, 2 bytes of bf16 gradient, and 12 bytes of fp32
    optimizer state (master parameter, Adam's first and second moments, 4 bytes each): 16 bytes. `strategy` says
    which of the three kinds is split evenly across the N ranks (a sharded kind costs its bytes / N):
      "ddp":   nothing sharded                              -> 2 + 2 + 12     = 16
      "zero1": optimizer state sharded                      -> 2 + 2 + 12/N   = 4 + 12/N
      "zero2": optimizer state and gradients sharded        -> 2 + 2/N + 12/N = 2 + 14/N
      "zero3": optimizer state, gradients and parameters    -> 2/N + 2/N + 12/N = 16/N
    Every field is a float. ValueError for an unknown strategy or world_size < 1.
    """
    raise NotImplementedError


def communication_volume(collective: str, num_bytes: int, world_size: int) -> float:
    """Communication volume of one collective over `world_size` = N ranks, in bytes sent per rank.

    Volume per rank = (bytes sent by all N ranks together, by a bandwidth-optimal algorithm) / N, so that the
    rooted collectives, whose ranks send unequal amounts, are averaged. B = `num_bytes` is:
      broadcast: the broadcast tensor                 -> (N - 1)/N * B   (every rank but the root receives B once)
      reduce: each rank's tensor                      -> (N - 1)/N * B   (every rank but the root sends B once)
      scatter: the root's whole input (N pieces)      -> (N - 1)/N * B / N   (N - 1 pieces of B/N leave the root)
      gather: the root's whole output (N pieces)      -> (N - 1)/N * B / N
      all_gather: the whole output (N pieces)         -> (N - 1)/N * B   (ring: N - 1 pieces of B/N per rank)
      reduce_scatter: each rank's whole input         -> (N - 1)/N * B   (ring: N - 1 chunks of B/N per rank)
      all_reduce: each rank's tensor                  -> 2 (N - 1)/N * B (ring reduce-scatter, then all-gather)
      all_to_all: each rank's whole input (N pieces)  -> (N - 1)/N * B   (each rank sends N - 1 pieces of B/N)
    With N = 1 every volume is 0. Returns a float. ValueError for an unknown collective, num_bytes < 0 or
    world_size < 1.
    """
    raise NotImplementedError


def transformer_layer_activations(seq_len: int, batch: int, hidden: int, heads: int, tensor_parallel: int = 1,
                                  sequence_parallel: bool = False) -> ActivationBytes:
    """Activation memory of one transformer layer per rank, following Korthikanti et al. (2022): s = seq_len,
    b = batch, h = hidden, a = heads, t = tensor_parallel; 16-bit activations (2 bytes per value), 1-byte dropout
    masks, no recomputation. In units of s*b*h bytes:

      attention: layer-norm output fed to the QKV projection 2, Q and K 4, V 2, input of the output projection 2,
                 dropout mask after the output projection 1 -> 11 s*b*h, plus softmax output 2 a*s*s*b, its dropout
                 mask a*s*s*b and the dropout output 2 a*s*s*b -> 5 a*s*s*b bytes
      mlp:       input of the first linear 2, input of the GeLU (4h wide) 8, input of the second linear (4h) 8,
                 dropout mask 1 -> 19 s*b*h
      layernorm: the inputs of the two layer norms, 2 + 2 -> 4 s*b*h
    Without parallelism the total is s*b*h*(34 + 5*a*s/h).

    Tensor parallelism (t ranks, sequence_parallel=False) divides by t what lies between a column-parallel and a
    row-parallel layer: Q, K, V, the output projection's input and the 5 a*s*s*b score terms (attention), the GeLU
    input and output (mlp). The rest (the QKV and first-linear inputs, the two dropout masks, the layer-norm inputs:
    10 s*b*h) is replicated: total s*b*h*(10 + 24/t + 5*a*s/(h*t)).
    Sequence parallelism (sequence_parallel=True) also splits those replicated 10 s*b*h along the sequence, so
    every term is divided by t: total s*b*h*(34 + 5*a*s/h)/t.

    Each field is an exact int (the divisibility rules below make every term whole). ValueError when any size is
    < 1, hidden % heads != 0, heads % tensor_parallel != 0, or sequence_parallel and seq_len % tensor_parallel != 0.
    """
    raise NotImplementedError
