"""Total and activated parameter counts of a mixture-of-experts transformer.

Wrong on purpose: the activated count leaves out the shared experts.
"""

from __future__ import annotations

from typing import NamedTuple


class ParameterCounts(NamedTuple):
    embedding: int  # input embedding, plus the output projection unless tied
    attention: int  # all layers
    norms: int  # all RMSNorm weights
    dense_mlp: int  # the feed-forward blocks of the dense layers
    router: int  # all MoE layers
    shared_experts: int  # all MoE layers
    routed_experts: int  # every routed expert of every MoE layer
    activated_routed_experts: int  # the k routed experts one token uses, in every MoE layer
    total: int
    activated: int


_AT_LEAST_ONE = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "num_routed_experts", "expert_intermediate_size")


def _check_arguments(arguments: dict) -> None:
    for name, value in arguments.items():
        wanted = bool if name == "tied_embeddings" else int
        if type(value) is not wanted:  # not isinstance: a bool is an int
            raise TypeError(f"{name} must be {wanted.__name__}, got {type(value).__name__} {value!r}")
    for name in _AT_LEAST_ONE:
        if arguments[name] < 1:
            raise ValueError(f"{name} must be at least 1, got {arguments[name]}")
    if arguments["num_heads"] % arguments["num_kv_heads"]:
        raise ValueError(f"num_heads={arguments['num_heads']} is not a multiple of "
                         f"num_kv_heads={arguments['num_kv_heads']}")
    if not 1 <= arguments["experts_per_token"] <= arguments["num_routed_experts"]:
        raise ValueError(f"experts_per_token must be in [1, num_routed_experts={arguments['num_routed_experts']}], "
                         f"got {arguments['experts_per_token']}")
    if arguments["num_shared_experts"] < 0:
        raise ValueError(f"num_shared_experts must not be negative, got {arguments['num_shared_experts']}")
    if not 0 <= arguments["num_dense_layers"] <= arguments["num_layers"]:
        raise ValueError(f"num_dense_layers must be in [0, num_layers={arguments['num_layers']}], "
                         f"got {arguments['num_dense_layers']}")
    dense_size = arguments["dense_intermediate_size"]
    if dense_size < 0 or (dense_size == 0 and arguments["num_dense_layers"] > 0):
        raise ValueError(f"dense_intermediate_size must be positive when there are dense layers, got {dense_size}")


def parameter_counts(
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_routed_experts: int,
    experts_per_token: int,
    expert_intermediate_size: int,
    num_shared_experts: int = 0,
    num_dense_layers: int = 0,
    dense_intermediate_size: int = 0,
    tied_embeddings: bool = False,
) -> ParameterCounts:
    """Count the parameters of a decoder-only MoE transformer. See the stub's docstring for the architecture."""
    _check_arguments(locals())
    swiglu_expert = 3 * hidden_size * expert_intermediate_size
    moe_layers = num_layers - num_dense_layers

    embedding = (1 if tied_embeddings else 2) * vocab_size * hidden_size
    query_and_output = 2 * hidden_size * num_heads * head_dim
    key_and_value = 2 * hidden_size * num_kv_heads * head_dim
    attention = num_layers * (query_and_output + key_and_value)
    norms = (2 * num_layers + 1) * hidden_size
    dense_mlp = num_dense_layers * 3 * hidden_size * dense_intermediate_size
    router = moe_layers * hidden_size * num_routed_experts
    shared_experts = moe_layers * num_shared_experts * swiglu_expert
    routed_experts = moe_layers * num_routed_experts * swiglu_expert
    activated_routed_experts = moe_layers * experts_per_token * swiglu_expert

    always_used = embedding + attention + norms + dense_mlp + router + shared_experts
    return ParameterCounts(
        embedding, attention, norms, dense_mlp, router, shared_experts, routed_experts, activated_routed_experts,
        total=always_used + routed_experts,
        activated=always_used - shared_experts + activated_routed_experts,
    )
