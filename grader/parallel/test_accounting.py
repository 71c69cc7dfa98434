"""Grading parallel.accounting: memory per parameter under DDP and ZeRO, communication volume per collective,
activation memory of a transformer layer with tensor and sequence parallelism.

Expected values come from the reference's `_torch` functions, which write each formula as it is usually quoted
(16, 4 + 12/N, 2 + 14/N, 16/N; s*b*h*(34 + 5as/h) and its parallel forms): floating results must agree to a
relative 1e-12, the activation byte counts (whole numbers under the contract's divisibility rules) exactly.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_raises
from grader.checks.outcomes import WrongAnswer
from grader.checks.profiles import examples

PROBLEM = BY_ID["parallel.accounting"]
RELATIVE_TOLERANCE = 1e-12
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
COLLECTIVES = ("broadcast", "reduce", "scatter", "gather", "all_gather", "reduce_scatter", "all_reduce", "all_to_all")
MEMORY_FIELDS = ("parameters", "gradients", "optimizer_state", "total")
ACTIVATION_FIELDS = ("attention", "mlp", "layernorm", "total")

world_sizes = st.one_of(st.sampled_from((1, 2, 3, 4, 7, 8, 64, 1000)), st.integers(1, 1 << 16))


def fields(value, names: tuple[str, ...], call: str) -> dict:
    if not isinstance(value, tuple) or len(value) != len(names):
        raise WrongAnswer(f"{call} must return a NamedTuple of {len(names)} fields {names}, got {value!r:.200}")
    return dict(zip(names, value))


def check_number(got, expected: float, what: str, exact: bool = False) -> None:
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise WrongAnswer(f"{what}: expected a number, got {got!r:.100}")
    ok = got == expected if exact else math.isclose(got, expected, rel_tol=RELATIVE_TOLERANCE, abs_tol=0.0)
    if not ok:
        bound = "exactly" if exact else f"to a relative {RELATIVE_TOLERANCE:g}"
        raise WrongAnswer(f"{what} = {got!r}, expected {expected!r} ({bound})")


@examples(PROBLEM)
@given(strategy=st.sampled_from(STRATEGIES), world_size=world_sizes)
def test_bytes_per_parameter(student, reference, strategy, world_size):
    call = f"bytes_per_parameter({strategy!r}, world_size={world_size})"
    got = fields(student.call("bytes_per_parameter", strategy, world_size), MEMORY_FIELDS, call)
    expected = reference.bytes_per_parameter_torch(strategy, world_size)._asdict()
    for name in MEMORY_FIELDS:
        check_number(got[name], expected[name], f"{call}.{name}")


@examples(PROBLEM)
@given(collective=st.sampled_from(COLLECTIVES), num_bytes=st.integers(0, 1 << 50), world_size=world_sizes)
def test_communication_volume(student, reference, collective, num_bytes, world_size):
    call = f"communication_volume({collective!r}, num_bytes={num_bytes}, world_size={world_size})"
    got = student.call("communication_volume", collective, num_bytes, world_size)
    check_number(got, reference.communication_volume(collective, num_bytes, world_size),
                 f"{call} (bytes sent per rank, averaged over the ranks)")


@st.composite
def layers(draw, tensor_parallel: bool, sequence_parallel: bool) -> dict:
    """Sizes that satisfy the contract: heads divisible by t, hidden by heads, and seq_len by t under sequence
    parallelism."""
    t = draw(st.sampled_from((1, 2, 3, 4, 8)) | st.integers(1, 16)) if tensor_parallel else 1
    heads = t * draw(st.integers(1, 16))
    seq_len = draw(st.integers(1, 8192))
    if sequence_parallel:
        seq_len = t * max(1, seq_len // t)
    return {"seq_len": seq_len, "batch": draw(st.integers(1, 64)), "hidden": heads * draw(st.integers(1, 256)),
            "heads": heads, "tensor_parallel": t, "sequence_parallel": sequence_parallel}


def check_activations(student, reference, layer: dict) -> None:
    arguments = ", ".join(f"{k}={v}" for k, v in layer.items())
    call = f"transformer_layer_activations({arguments})"
    got = fields(student.call("transformer_layer_activations", **layer), ACTIVATION_FIELDS, call)
    expected = reference.transformer_layer_activations_torch(**layer)._asdict()
    for name in ACTIVATION_FIELDS:
        check_number(got[name], expected[name], f"{call}.{name}", exact=True)


@examples(PROBLEM)
@given(layer=layers(tensor_parallel=False, sequence_parallel=False))
def test_activations(student, reference, layer):
    check_activations(student, reference, layer)


@examples(PROBLEM)
@given(layer=layers(tensor_parallel=True, sequence_parallel=False))
def test_tensor_parallel_activations(student, reference, layer):
    check_activations(student, reference, layer)


@examples(PROBLEM)
@given(layer=layers(tensor_parallel=True, sequence_parallel=True))
def test_sequence_parallel_activations(student, reference, layer):
    check_activations(student, reference, layer)


INVALID = [
    pytest.param("bytes_per_parameter", ("zero4", 8), {}, id="unknown-strategy"),
    pytest.param("bytes_per_parameter", ("zero1", 0), {}, id="world_size=0"),
    pytest.param("communication_volume", ("all_reduce_ring", 1024, 4), {}, id="unknown-collective"),
    pytest.param("communication_volume", ("all_gather", -1, 4), {}, id="negative-bytes"),
    pytest.param("communication_volume", ("broadcast", 1024, 0), {}, id="volume-world_size=0"),
    pytest.param("transformer_layer_activations", (0, 2, 64, 8), {}, id="seq_len=0"),
    pytest.param("transformer_layer_activations", (16, 2, 60, 8), {}, id="hidden-not-multiple-of-heads"),
    pytest.param("transformer_layer_activations", (16, 2, 64, 8), {"tensor_parallel": 3}, id="heads-not-split"),
    pytest.param("transformer_layer_activations", (10, 2, 64, 8), {"tensor_parallel": 4, "sequence_parallel": True},
                 id="seq_len-not-split"),
    pytest.param("transformer_layer_activations", (16, 2, 64, 8), {"tensor_parallel": 0}, id="tensor_parallel=0"),
    # "a bool is not an accepted integer", although Python counts True as the int 1.
    pytest.param("bytes_per_parameter", ("zero2", True), {}, id="world_size=True"),
    pytest.param("communication_volume", ("all_gather", True, 4), {}, id="num_bytes=True"),
    pytest.param("transformer_layer_activations", (16, True, 64, 8), {}, id="batch=True"),
]


@pytest.mark.parametrize("function, args, kwargs", INVALID)
def test_invalid_arguments(student, function, args, kwargs):
    arguments = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
    assert_raises(student.raises(function, *args, **kwargs), "ValueError", f"{function}({arguments})")
