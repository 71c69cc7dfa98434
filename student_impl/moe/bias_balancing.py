"""Auxiliary-loss-free load balancing: after a step, nudge each expert's selection bias against its load."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class BiasUpdate(NamedTuple):
    tokens_per_expert_E: Tensor  # int64 [E]
    expert_bias_E: Tensor  # float32 [E]


def update_expert_bias(scores_TE: Tensor, expert_bias_E: Tensor, k: int, update_rate: float) -> BiasUpdate:
    """Count each expert's load under biased top-k selection, then move every bias one step against its load.

    Arguments:
        scores_TE: routing affinities of T tokens for E experts, shape [T, E], a floating dtype (any real values).
        expert_bias_E: the current per-expert selection bias, shape [E], a floating dtype. It is not modified.
        k: number of experts per token, 1 <= k <= E.
        update_rate: gamma, the step size: a finite number >= 0 (0 leaves every bias unchanged).

    Computation (all in float32):
        selection_TE = scores_TE + expert_bias_E, both cast to float32 first, one float32 addition per entry.
        Each token chooses the k experts of highest selection score; among equal scores the lower expert index
            is chosen first. (torch.topk makes no such promise for ties.)
        load_i = the number of tokens that chose expert i; the mean load is T * k / E (a rational number: compare
            exactly, e.g. load_i * E against T * k).
        New bias, with gamma = update_rate rounded to float32 and one float32 addition or subtraction:
            b_i - gamma   if load_i > T * k / E   (overloaded: make the expert less attractive),
            b_i + gamma   if load_i < T * k / E   (underloaded: more attractive),
            b_i           if load_i == T * k / E  (exactly at the mean: unchanged; sign(0) = 0).
        The update is not centred: the mean of the steps is not subtracted, so the sum of the biases may drift.
        Only the sign of load_i - mean matters, never its size.

    Returns a BiasUpdate whose fields, in this order, are:
        tokens_per_expert_E: int64 [E], the loads; they sum to T * k.
        expert_bias_E: float32 [E], the new bias (a new tensor).

    Neither output carries a gradient. Devices: CPU or CUDA; every output is on the device of `scores_TE` (both
    inputs are on the same device).

    Raises:
        TypeError: if `scores_TE` or `expert_bias_E` has a non-floating dtype.
        ValueError: if `scores_TE` is not 2-D, T == 0, `expert_bias_E` is not of shape [E], k is not in [1, E], or
            update_rate is negative or not finite.
    """
    raise NotImplementedError
