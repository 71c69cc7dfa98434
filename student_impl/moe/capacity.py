"""Expert capacity and token dropping for top-k token-choice routing."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class CapacityOutput(NamedTuple):
    capacity: int  # slots per expert
    kept_TK: Tensor  # bool [T, k]
    position_TK: Tensor  # int64 [T, k]
    gate_TK: Tensor  # dtype of the input gates, [T, k]
    tokens_per_expert_E: Tensor  # int64 [E]


def apply_capacity(expert_index_TK: Tensor, gate_TK: Tensor, num_experts: int,
                   capacity_factor: float) -> CapacityOutput:
    """Give each expert a buffer of `capacity` slots and drop the (token, expert) assignments that do not fit.

    The routing is given: token t was sent to experts expert_index_TK[t, 0], ..., expert_index_TK[t, k-1] (its
    "slots" 0 to k-1, as listed by a router, first choice first) with gates gate_TK[t, :].

    Arguments:
        expert_index_TK: int64 [T, k], T >= 1, k >= 1; every entry in [0, num_experts), and the k experts of a
            token are distinct.
        gate_TK: [T, k], a floating dtype, on the device of `expert_index_TK`.
        num_experts: E >= 1.
        capacity_factor: a float > 0.

    Capacity (pinned):
        capacity = ceil(capacity_factor * T * k / E), computed as math.ceil(capacity_factor * T * k / num_experts)
        on Python floats. It is not capped at T.

    Priority (pinned, slot-major): an expert fills its buffer with the assignments it receives in this order:
        all slot-0 assignments (first choices) by ascending token index, then all slot-1 assignments by ascending
        token index, and so on up to slot k-1. The first `capacity` assignments an expert receives in that order
        are kept; every later one is dropped. A dropped assignment is not given to any other expert.

    Returns a CapacityOutput whose fields, in this order, are:
        capacity: the Python int above.
        kept_TK: bool [T, k], whether assignment (t, j) was kept.
        position_TK: int64 [T, k], for a kept assignment its slot in its expert's buffer: the number of
            assignments to the same expert that precede it in priority order (0 to capacity - 1); -1 for a
            dropped assignment.
        gate_TK: the input gates where kept and exactly 0 where dropped, in the input's dtype. The kept gates are
            NOT renormalised: a token that lost one of its experts simply receives less.
        tokens_per_expert_E: int64 [E], the number of kept assignments of each expert (at most capacity).

    Gradients: the returned gate_TK is differentiable with respect to the input gate_TK (the gradient is the
    upstream gradient where kept, 0 where dropped). The other outputs carry no gradient.

    Devices: CPU or CUDA; tensors are returned on the device of the inputs.

    Raises:
        TypeError: if `expert_index_TK` is not int64 or `gate_TK` is not floating.
        ValueError: if either input is not 2-D, their shapes differ, T == 0 or k == 0, num_experts < 1,
            capacity_factor <= 0, an expert index is outside [0, num_experts), or a token lists an expert twice.
    """
    raise NotImplementedError
