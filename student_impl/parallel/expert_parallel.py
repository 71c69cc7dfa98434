"""Expert parallelism: a mixture-of-experts layer whose experts are split across ranks, tokens dispatched to their
experts' ranks with all_to_all and the results combined back."""

from __future__ import annotations

import torch
import torch.distributed as dist  # all_to_all_single lives here
from torch import Tensor


def expert_parallel_moe(
    x_TD: Tensor,
    expert_index_TK: Tensor,
    gate_TK: Tensor,
    w_in_EDH: Tensor,
    w_out_EHD: Tensor,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """One mixture-of-experts layer with its E experts split over the N ranks of `group`; differentiable.

    Environment (set up by the caller, not by you):
      * torch.distributed is initialised. The layer's ranks are the process group `group` (None: the default
        group): N = dist.get_world_size(group), this rank is r = dist.get_rank(group). Pass `group=group` to every
        collective.
      * Every rank of the group calls this function once per forward, with its own tokens.

    Expert ownership (pinned): E = num_experts is divisible by N; rank r owns the E/N experts
    [r * E/N, (r + 1) * E/N). Its local expert e (0 <= e < E/N) is global expert r * E/N + e.

    Expert (pinned): a two-layer MLP without biases, expert_e(x) = silu(x @ W_in[e]) @ W_out[e] for a row x of width
    D, hidden width H.

    Arguments (all on this rank's device; x_TD, gate_TK and the weights share one floating dtype):
        x_TD: this rank's T tokens, [T, D]. T may differ between ranks and may be 0.
        expert_index_TK: int64 [T, k], the global experts each token is routed to (k distinct experts per token,
            chosen by a router that is not part of this problem).
        gate_TK: [T, k], the weight of each of those experts' outputs.
        w_in_EDH: [E/N, D, H], the weights W_in of this rank's own experts, local expert e at index e.
        w_out_EHD: [E/N, H, D], the weights W_out of this rank's own experts.
        num_experts: E.
        group: the process group of the expert-parallel ranks (None: the default group).

    Returns y_TD, [T, D] in x_TD's dtype: y[t] = sum_j gate_TK[t, j] * expert_{expert_index_TK[t, j]}(x_TD[t]),
    exactly what one process holding all tokens and all experts computes (each gate applied once). Backward through
    y_TD gives every rank the gradients of its own x_TD, gate_TK, w_in_EDH and w_out_EHD that single-process
    autograd would give (a local expert that received no token gets a zero gradient).

    Communication (pinned, and measured):
      1. Counts: each rank tells every other how many of its (token, expert) assignments go to each of that rank's
         experts, with dist.all_to_all_single on an int64 tensor of E counts.
      2. Dispatch: dist.all_to_all_single with input_split_sizes/output_split_sizes taken from those counts sends
         each token's row only to the ranks owning one of its experts (once per routed expert). Counts are uneven:
         some experts, and some pairs of ranks, exchange no tokens at all.
      3. Each rank runs its local experts on the rows it received.
      4. Combine: a second all_to_all_single, with the splits reversed, returns each result to its token's rank,
         where it is weighted by its gate and added into its token's row of y_TD.
      The backward pass communicates along the same routes reversed (all_to_all_single again; torch's collectives
      have no autograd, so wrap them in a torch.autograd.Function). The token rows a rank receives in one pass may
      total at most 1.25 x the minimum (the rows routed to its experts plus its own T * k results) plus 256 bytes
      and 16 N E bytes for counts; gathering every token on every rank exceeds that. Use all_to_all_single (gloo
      does not implement the list form dist.all_to_all).

    Raises:
        ValueError: if num_experts is not divisible by N, or w_in_EDH or w_out_EHD does not hold E/N experts.
    """
    raise NotImplementedError
