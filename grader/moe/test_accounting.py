"""Grading moe.accounting: total and activated parameter counts of an MoE transformer configuration.

Counts are integers and are compared exactly, field by field. The published-shape tests spell out every expected
term as arithmetic on the configuration, independently of the reference; Mixtral 8x7B's totals are also checked
against its published counts. The drawn configurations are compared with the reference.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_raises
from grader.checks.outcomes import WrongAnswer
from grader.checks.profiles import examples

PROBLEM = BY_ID["moe.accounting"]
FIELDS = ("embedding", "attention", "norms", "dense_mlp", "router", "shared_experts", "routed_experts",
          "activated_routed_experts", "total", "activated")


def describe(config: dict) -> str:
    return ", ".join(f"{name}={value}" for name, value in config.items())


def check_counts(student, config: dict, expected: dict) -> None:
    """Every field of the student's ParameterCounts equals the expected int."""
    context = describe(config)
    with student.describing(context):
        value = student.call("parameter_counts", **config)
    if not isinstance(value, tuple) or len(value) != len(FIELDS):
        raise WrongAnswer(f"parameter_counts must return a ParameterCounts of {len(FIELDS)} fields, got "
                          f"{value!r:.200} ({context})")
    for name, actual in zip(FIELDS, value):
        if type(actual) is not int:
            raise WrongAnswer(f"{name}: expected a Python int, got {type(actual).__name__} {actual!r:.80} ({context})")
    wrong = [f"{name}: got {actual:,}, expected {expected[name]:,} (off by {actual - expected[name]:+,})"
             for name, actual in zip(FIELDS, value) if actual != expected[name]]
    if wrong:
        raise WrongAnswer("; ".join(wrong) + f" ({context})")


# Each expected count below is written term by term from the architecture pinned in the contract:
# attention per layer = 2 H (heads x head_dim) [query, output] + 2 H (kv heads x head_dim) [key, value];
# a SwiGLU block of intermediate size I has 3 H I parameters; norms = (2 L + 1) H.
MIXTRAL_8X7B = dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                    num_routed_experts=8, experts_per_token=2, expert_intermediate_size=14336)
MIXTRAL_8X7B_COUNTS = dict(
    embedding=2 * 32000 * 4096,
    attention=32 * (2 * 4096 * 32 * 128 + 2 * 4096 * 8 * 128),
    norms=(2 * 32 + 1) * 4096,
    dense_mlp=0,
    router=32 * 4096 * 8,
    shared_experts=0,
    routed_experts=32 * 8 * 3 * 4096 * 14336,
    activated_routed_experts=32 * 2 * 3 * 4096 * 14336,
    # Mixtral 8x7B's published counts: 46.7B in total, 12.9B activated.
    total=46_702_792_704,
    activated=12_879_925_248,
)

# DeepSeek-V3's embedding, layer, dense-block and expert shapes (61 layers, the first 3 dense; 256 routed experts
# of which 8 per token, 1 shared), with multi-head attention of 128 heads of 128 in place of its latent attention.
DEEPSEEK_V3_SHAPES = dict(vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, num_kv_heads=128,
                          head_dim=128, num_routed_experts=256, experts_per_token=8, expert_intermediate_size=2048,
                          num_shared_experts=1, num_dense_layers=3, dense_intermediate_size=18432)
DEEPSEEK_V3_SHAPES_COUNTS = dict(
    embedding=2 * 129280 * 7168,
    attention=61 * (2 * 7168 * 128 * 128 + 2 * 7168 * 128 * 128),
    norms=(2 * 61 + 1) * 7168,
    dense_mlp=3 * 3 * 7168 * 18432,
    router=58 * 7168 * 256,
    shared_experts=58 * 1 * 3 * 7168 * 2048,
    routed_experts=58 * 256 * 3 * 7168 * 2048,
    activated_routed_experts=58 * 8 * 3 * 7168 * 2048,
)

# Fine-grained experts with several shared ones (Qwen1.5-MoE-A2.7B's shapes, without its biases and shared gate).
QWEN_MOE_SHAPES = dict(vocab_size=151936, hidden_size=2048, num_layers=24, num_heads=16, num_kv_heads=16,
                       head_dim=128, num_routed_experts=60, experts_per_token=4, expert_intermediate_size=1408,
                       num_shared_experts=4)
QWEN_MOE_SHAPES_COUNTS = dict(
    embedding=2 * 151936 * 2048,
    attention=24 * (2 * 2048 * 16 * 128 + 2 * 2048 * 16 * 128),
    norms=(2 * 24 + 1) * 2048,
    dense_mlp=0,
    router=24 * 2048 * 60,
    shared_experts=24 * 4 * 3 * 2048 * 1408,
    routed_experts=24 * 60 * 3 * 2048 * 1408,
    activated_routed_experts=24 * 4 * 3 * 2048 * 1408,
)

# A small model with tied embeddings, one dense layer, single-query attention and top-1 routing.
SMALL_TIED = dict(vocab_size=1000, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=1, head_dim=16,
                  num_routed_experts=4, experts_per_token=1, expert_intermediate_size=96, num_shared_experts=1,
                  num_dense_layers=1, dense_intermediate_size=256, tied_embeddings=True)
SMALL_TIED_COUNTS = dict(
    embedding=1000 * 64,
    attention=4 * (2 * 64 * 4 * 16 + 2 * 64 * 1 * 16),
    norms=(2 * 4 + 1) * 64,
    dense_mlp=1 * 3 * 64 * 256,
    router=3 * 64 * 4,
    shared_experts=3 * 1 * 3 * 64 * 96,
    routed_experts=3 * 4 * 3 * 64 * 96,
    activated_routed_experts=3 * 1 * 3 * 64 * 96,
)


def with_totals(counts: dict) -> dict:
    always_used = sum(counts[name] for name in FIELDS[:6])
    return {**counts, "total": always_used + counts["routed_experts"],
            "activated": always_used + counts["activated_routed_experts"]}


PUBLISHED = [
    pytest.param(MIXTRAL_8X7B, MIXTRAL_8X7B_COUNTS, id="mixtral-8x7b"),
    pytest.param(DEEPSEEK_V3_SHAPES, with_totals(DEEPSEEK_V3_SHAPES_COUNTS), id="deepseek-v3-shapes"),
    pytest.param(QWEN_MOE_SHAPES, with_totals(QWEN_MOE_SHAPES_COUNTS), id="qwen-moe-shapes"),
    pytest.param(SMALL_TIED, with_totals(SMALL_TIED_COUNTS), id="small-tied"),
]


@pytest.mark.parametrize("config, expected", PUBLISHED)
def test_published_shapes(student, config, expected):
    check_counts(student, config, expected)


@st.composite
def configs(draw) -> dict:
    num_layers = draw(st.integers(1, 100))
    num_kv_heads = draw(st.integers(1, 16))
    num_routed_experts = draw(st.integers(1, 512))
    num_dense_layers = draw(st.integers(0, num_layers))
    return dict(
        vocab_size=draw(st.integers(1, 300_000)),
        hidden_size=draw(st.integers(1, 16384)),
        num_layers=num_layers,
        num_heads=num_kv_heads * draw(st.integers(1, 8)),
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.integers(1, 256)),
        num_routed_experts=num_routed_experts,
        experts_per_token=draw(st.integers(1, num_routed_experts)),
        expert_intermediate_size=draw(st.integers(1, 8192)),
        num_shared_experts=draw(st.integers(0, 8)),
        num_dense_layers=num_dense_layers,
        dense_intermediate_size=draw(st.integers(1 if num_dense_layers else 0, 65536)),
        tied_embeddings=draw(st.booleans()),
    )


@examples(PROBLEM)
@given(config=configs())
def test_drawn_configs(student, reference, config):
    check_counts(student, config, reference.parameter_counts(**config)._asdict())


def invalid(error: str, **changes):
    config = {**SMALL_TIED, **changes}
    return pytest.param(config, error, id=",".join(f"{name}={value}" for name, value in changes.items()))


INVALID = [
    invalid("ValueError", hidden_size=0),
    invalid("ValueError", vocab_size=0),
    invalid("ValueError", num_layers=0, num_dense_layers=0),
    invalid("ValueError", num_heads=6, num_kv_heads=4),
    invalid("ValueError", head_dim=0),
    invalid("ValueError", num_routed_experts=0, experts_per_token=0),
    invalid("ValueError", experts_per_token=0),
    invalid("ValueError", experts_per_token=5),
    invalid("ValueError", expert_intermediate_size=0),
    invalid("ValueError", num_shared_experts=-1),
    invalid("ValueError", num_dense_layers=5),
    invalid("ValueError", num_dense_layers=-1),
    invalid("ValueError", dense_intermediate_size=0),
    invalid("TypeError", hidden_size=64.0),
    invalid("TypeError", num_routed_experts=True),
    invalid("TypeError", tied_embeddings=1),
]


@pytest.mark.parametrize("config, expected_error", INVALID)
def test_invalid_arguments(student, config, expected_error):
    assert_raises(student.raises("parameter_counts", **config), expected_error,
                  f"parameter_counts({describe(config)})")
