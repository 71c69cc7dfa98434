"""The accounting section's self-check: every number of its answers recomputed with the reference's own
`reference.parallel.accounting` functions and, for the activations, from the section's closed forms."""

from reference.parallel.accounting import bytes_per_parameter, communication_volume, transformer_layer_activations

MIB = 2**20


def test_zero2_on_8_ranks():
    state = bytes_per_parameter("zero2", 8)
    assert (state.parameters, state.gradients, state.optimizer_state, state.total) == (2, 0.25, 1.5, 3.75)
    assert state.total == 2 + 14 / 8
    assert state.total * 1.3e9 == 4.875e9


def test_all_gather_volume_takes_the_output():
    assert communication_volume("all_gather", 2**30, 4) == 805_306_368 == 768 * MIB
    assert communication_volume("all_gather", 256 * MIB, 4) == 192 * MIB  # the mistake: the input as B


def test_layer_activations():
    s, b, h, a, t = 2048, 1, 4096, 32, 8
    sbh = s * b * h
    assert sbh == 2**23 and 5 * a * s // h == 80
    alone = transformer_layer_activations(s, b, h, a)
    tensor = transformer_layer_activations(s, b, h, a, t)
    sequence = transformer_layer_activations(s, b, h, a, t, True)
    assert alone.total == sbh * 114 == 956_301_312 == 912 * MIB
    assert tensor.total == sbh * (10 + 24 // t + 80 // t) == sbh * 23 == 192_937_984 == 184 * MIB
    assert sequence.total == sbh * 114 // t == 119_537_664 == 114 * MIB
    assert 5 * a * s * s * b == 640 * MIB
