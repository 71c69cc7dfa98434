"""Wrong on purpose: ZeRO-2 shards only the optimizer state, like ZeRO-1: 4 + 12/N bytes per parameter."""

from __future__ import annotations

from typing import NamedTuple

# Mixed-precision Adam, per parameter: a bf16 parameter and a bf16 gradient, and in fp32 the master parameter and
# Adam's two moments.
PARAMETER_BYTES = 2
GRADIENT_BYTES = 2
OPTIMIZER_STATE_BYTES = 4 + 4 + 4

# Which of the three kinds each strategy splits across the N data-parallel ranks.
SHARDED = {
    "ddp": (False, False, False),
    "zero1": (False, False, True),
    "zero2": (False, False, True),
    "zero3": (True, True, True),
}

COLLECTIVES = ("broadcast", "reduce", "scatter", "gather", "all_gather", "reduce_scatter", "all_reduce", "all_to_all")


class BytesPerParameter(NamedTuple):
    parameters: float
    gradients: float
    optimizer_state: float
    total: float


class ActivationBytes(NamedTuple):
    attention: int
    mlp: int
    layernorm: int
    total: int


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")


def bytes_per_parameter(strategy: str, world_size: int) -> BytesPerParameter:
    if strategy not in SHARDED:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(SHARDED)}")
    _check_world_size(world_size)
    parts = [size / world_size if sharded else float(size)
             for size, sharded in zip((PARAMETER_BYTES, GRADIENT_BYTES, OPTIMIZER_STATE_BYTES), SHARDED[strategy])]
    return BytesPerParameter(*parts, sum(parts))


def bytes_per_parameter_torch(strategy: str, world_size: int) -> BytesPerParameter:
    """The same, from the totals as usually quoted: 16, 4 + 12/N, 2 + 14/N and 16/N bytes."""
    n = world_size
    parts = {"ddp": (2.0, 2.0, 12.0), "zero1": (2.0, 2.0, 12 / n), "zero2": (2.0, 2 / n, 12 / n),
             "zero3": (2 / n, 2 / n, 12 / n)}[strategy]
    total = {"ddp": 16.0, "zero1": 4 + 12 / n, "zero2": 2 + 14 / n, "zero3": 16 / n}[strategy]
    return BytesPerParameter(*parts, total)


def communication_volume(collective: str, num_bytes: int, world_size: int) -> float:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 0:
        raise ValueError(f"num_bytes must be an integer >= 0, got {num_bytes!r}")
    _check_world_size(world_size)
    # Bytes sent by all ranks together, over N. Every byte of a broadcast, reduce, all-gather, reduce-scatter or
    # all-to-all must cross the network once per rank that lacks it, (N - 1) * B in all; scatter and gather move
    # only the N - 1 pieces that are not the root's own; the ring all-reduce is a reduce-scatter plus an all-gather.
    fraction = (world_size - 1) / world_size
    if collective in ("scatter", "gather"):
        return num_bytes * fraction / world_size
    if collective == "all_reduce":
        return 2 * num_bytes * fraction
    return num_bytes * fraction


def _check_layer(seq_len: int, batch: int, hidden: int, heads: int, tensor_parallel: int,
                 sequence_parallel: bool) -> None:
    sizes = {"seq_len": seq_len, "batch": batch, "hidden": hidden, "heads": heads, "tensor_parallel": tensor_parallel}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not a multiple of heads={heads}")
    if heads % tensor_parallel:
        raise ValueError(f"heads={heads} cannot be split across tensor_parallel={tensor_parallel} ranks")
    if sequence_parallel and seq_len % tensor_parallel:
        raise ValueError(f"seq_len={seq_len} cannot be split across tensor_parallel={tensor_parallel} ranks")


def transformer_layer_activations(seq_len: int, batch: int, hidden: int, heads: int, tensor_parallel: int = 1,
                                  sequence_parallel: bool = False) -> ActivationBytes:
    _check_layer(seq_len, batch, hidden, heads, tensor_parallel, sequence_parallel)
    t = tensor_parallel
    sbh = seq_len * batch * hidden
    scores = heads * seq_len * seq_len * batch  # a*s*s*b: one attention score per head, query and key
    # Terms in units of sbh bytes (16-bit values, 1-byte dropout masks). The tensor-parallel regions (between the
    # column- and the row-parallel linear layers) hold 1/t of their activations on each rank; the rest (layer-norm
    # inputs, the inputs of the two column-parallel layers, the two dropout masks after the row-parallel layers) is
    # replicated, unless sequence parallelism splits it along the sequence too.
    split_region = t if sequence_parallel else 1
    attention = (2 + 1) * sbh // split_region + (4 + 2 + 2) * sbh // t + 5 * scores // t
    mlp = (2 + 1) * sbh // split_region + (8 + 8) * sbh // t
    layernorm = (2 + 2) * sbh // split_region
    return ActivationBytes(attention, mlp, layernorm, attention + mlp + layernorm)


def transformer_layer_activations_torch(seq_len: int, batch: int, hidden: int, heads: int, tensor_parallel: int = 1,
                                        sequence_parallel: bool = False) -> ActivationBytes:
    """The totals as Korthikanti et al. write them: sbh (34 + 5as/h), sbh (10 + 24/t + 5as/(ht)), sbh/t (34 + 5as/h),
    per block."""
    s, b, h, a, t = seq_len, batch, hidden, heads, tensor_parallel
    if sequence_parallel:
        attention, mlp, layernorm = (11 * s * b * h + 5 * a * s * s * b) // t, 19 * s * b * h // t, 4 * s * b * h // t
    else:
        attention = 3 * s * b * h + (8 * s * b * h + 5 * a * s * s * b) // t
        mlp = 3 * s * b * h + 16 * s * b * h // t
        layernorm = 4 * s * b * h
    return ActivationBytes(attention, mlp, layernorm, attention + mlp + layernorm)
