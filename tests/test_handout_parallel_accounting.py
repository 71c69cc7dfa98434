"""The accounting section's self-check: every number of its answers recomputed with the reference's own
`reference.parallel.accounting` functions, cross-checked against the totals as Korthikanti et al. write them
(`transformer_layer_activations_torch`) and against the bytes the reference's ring all-gather sends, measured on
simulated ranks; each printed number is also looked up in the section."""

from pathlib import Path

from reference.parallel.accounting import (
    bytes_per_parameter,
    communication_volume,
    transformer_layer_activations,
    transformer_layer_activations_torch,
)
from tests.thread_ranks import bytes_sent_per_rank

MIB = 2**20
SECTION = Path(__file__).resolve().parents[1] / "assignment/handout/sections/parallel/accounting.typ"


def assert_printed(*strings):
    text = " ".join(SECTION.read_text().split())
    for printed in strings:
        assert printed in text, printed


def test_zero2_on_8_ranks():
    state = bytes_per_parameter("zero2", 8)
    assert (state.parameters, state.gradients, state.optimizer_state, state.total) == (2, 0.25, 1.5, 3.75)
    assert state.total * 1.3e9 == 4.875e9
    assert_printed("(1) $2 + 14 slash 8 = 3.75$ bytes, $4.875 times 10^9$ per rank")


def test_all_gather_volume_takes_the_output(monkeypatch):
    # Measured: a ring all-gather of 4 pieces of 16 float32 values (256 output bytes), scaled to 1 GiB of output.
    measured = bytes_sent_per_rank(monkeypatch, "all_gather", 4, 64) * 2**30 // 256
    assert communication_volume("all_gather", 2**30, 4) == measured == 805_306_368
    assert measured / MIB == 768
    assert communication_volume("all_gather", 256 * MIB, 4) / MIB == 192  # the mistake: the input as B
    assert_printed("$B = 1$ GiB, the output: $805 thin 306 thin 368$ bytes (768 MiB); the input would give 192 MiB")


def test_layer_activations():
    s, b, h, a, t = 2048, 1, 4096, 32, 8
    alone = transformer_layer_activations(s, b, h, a)
    tensor = transformer_layer_activations(s, b, h, a, t)
    sequence = transformer_layer_activations(s, b, h, a, t, True)
    for layer, kwargs in ((alone, {}), (tensor, {"tensor_parallel": t}),
                          (sequence, {"tensor_parallel": t, "sequence_parallel": True})):
        assert layer.total == transformer_layer_activations_torch(s, b, h, a, **kwargs).total
    assert (alone.total, tensor.total, sequence.total) == (956_301_312, 192_937_984, 119_537_664)
    assert (alone.total / MIB, tensor.total / MIB, sequence.total / MIB) == (912, 184, 114)
    # The scores' term is the only one that grows with the heads, linearly: halving a removes half of it.
    scores = 2 * (alone.total - transformer_layer_activations(s, b, h, a // 2).total)
    assert scores == 640 * MIB and scores > alone.total - scores
    assert_printed("$2^23 dot 114 = 956 thin 301 thin 312$ bytes (912 MiB)",
                   "$2^23 dot 23 = 192 thin 937 thin 984$ (184 MiB)",
                   "$2^23 dot 114 slash 8 = 119 thin 537 thin 664$ (114 MiB)", "$5 a s^2 b$, 640 MiB of the 912",
                   "($5 a s slash h = 80 > 34$)")
