"""Collective operations built from point-to-point messages: trees for the rooted ones, rings for the rest.

Rules for every function of this module:
  * Communicate ONLY with torch.distributed's send, recv, isend, irecv and batch_isend_irecv (with P2POp).
    Calling any torch.distributed collective (broadcast, all_reduce, all_gather, barrier, ...) fails the test,
    and so does reaching one another way: a ProcessGroup's own methods (`group.allreduce(...)`),
    torch.distributed._functional_collectives or the dispatcher's ops (`torch.ops.c10d.*`,
    `torch.ops._c10d_functional.*`).
  * `group` is a torch.distributed ProcessGroup, or None for the default (world) group. Use only that group:
    this rank is `dist.get_rank(group)` of `dist.get_world_size(group)` = N ranks. `src`, `dst` and list indices
    are ranks WITHIN the group (torch.distributed's own `src` is a global rank; here it is what torch calls
    `group_src`). To address group rank i in send/recv/P2POp, pass `group=group` and the global rank
    `dist.get_global_rank(group, i)` (just i when group is None).
  * Every rank of the group calls the function with the same src/dst/op and tensors of the same shapes and
    dtypes. Tensors are contiguous and live on this rank's device (CPU with gloo, the rank's GPU with NCCL).
  * op is `dist.ReduceOp.SUM` or `dist.ReduceOp.MAX`; any other op raises ValueError.
  * Never send to yourself (copy locally instead), and send each piece of data only as often as the stated
    byte bound allows: the grader sums the bytes of every send/isend and recv/irecv (and of those in
    batch_isend_irecv) per rank. It also holds each rank to a lower bound, what any correct algorithm must
    move through those calls (a rank that needs data only others hold receives at least that many bytes):
    data carried any other way does not count.
  * Invalid arguments raise ValueError on every rank, before any communication: src/dst outside [0, N), an
    unsupported op, a tensor list whose length is not N (checked on the rank that uses the list), list tensors
    whose shape or dtype differs from `tensor`'s (scatter, gather, all_gather), a reduce_scatter output of the
    wrong size or dtype.
  * A ring step in which every rank sends to its successor and receives from its predecessor must not block in
    the send before the receive is posted (NCCL would deadlock): use isend/irecv, or one batch_isend_irecv.

Chunks: reduce_scatter and all_reduce cut the flattened tensor of n elements into N chunks with
`flat.tensor_split(N)`: chunk i holds ceil(n/N) elements for i < n % N and floor(n/N) after that, in order; some
chunks are empty when n < N. Rank i owns chunk i.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """Copy `tensor` of rank `src` into `tensor` of every rank of the group, in place.

    Bytes: every rank other than src receives the tensor exactly once, so the bytes sent by all ranks together are
    (N - 1) * B for a tensor of B bytes (a linear or a binomial-tree broadcast; not scatter + all-gather).
    """
    raise NotImplementedError


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group: dist.ProcessGroup | None = None) -> None:
    """Rank `src` holds `scatter_list` of N tensors, each of `tensor`'s shape and dtype; afterwards `tensor` of rank
    i holds scatter_list[i] (rank src copies its own piece). On other ranks `scatter_list` is ignored (may be None).

    Bytes: each piece goes straight from src to its rank: src sends (N - 1) pieces, the others send nothing.
    """
    raise NotImplementedError


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group: dist.ProcessGroup | None = None) -> None:
    """The inverse of scatter: afterwards gather_list[i] on rank `dst` holds `tensor` of rank i. `gather_list`
    (N tensors of `tensor`'s shape and dtype) is used on dst only; elsewhere it is ignored (may be None).

    Bytes: each rank other than dst sends its tensor once, straight to dst; dst sends nothing.
    """
    raise NotImplementedError


def reduce(tensor: torch.Tensor, dst: int, op=dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> None:
    """Afterwards `tensor` on rank `dst` holds the elementwise reduction (op) of `tensor` over all ranks. On the
    other ranks `tensor`'s contents afterwards are unspecified (you may use it as an accumulator).

    Bytes: all ranks together send at most (N - 1) * B for a tensor of B bytes (each rank but dst sends one
    tensor: straight to dst, or to its parent in a tree).
    """
    raise NotImplementedError


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Afterwards tensor_list[i] on every rank holds `tensor` of rank i. `tensor_list` holds N tensors of
    `tensor`'s shape and dtype.

    Bytes: each rank sends at most (N - 1) * b for a `tensor` of b bytes (a ring, or direct sends).
    """
    raise NotImplementedError


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                   group: dist.ProcessGroup | None = None) -> None:
    """Reduce `input` (any shape, n elements) elementwise over all ranks and leave chunk i of the flattened result
    in `output` of rank i. `output` is 1-D with exactly len(chunk i) elements (see Chunks in the module docstring;
    possibly 0) and `input`'s dtype. `input` is left unchanged.

    Bytes: each rank sends at most (N - 1) * ceil(n / N) elements (a ring: N - 1 steps, one chunk each).
    """
    raise NotImplementedError


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> None:
    """Replace `tensor` (any shape, n elements) on every rank by the elementwise reduction over all ranks.

    Algorithm: the ring all-reduce: a ring reduce-scatter over the N chunks (see Chunks), then a ring all-gather of
    the reduced chunks. Bytes: each rank sends at most 2 * (N - 1) * ceil(n / N) elements, that is 2 (N - 1) / N of
    the tensor up to rounding of uneven chunks. Reducing to one rank and broadcasting sends far more from the root.
    """
    raise NotImplementedError


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: dist.ProcessGroup | None = None) -> None:
    """Afterwards output_tensor_list[j] on rank i holds input_tensor_list[i] of rank j: rank j's piece for rank i.
    Both lists hold N tensors; the sizes may differ from pair to pair (even 0 elements) but each output tensor
    already has the shape of the piece it will receive. The piece for yourself is copied locally.

    Bytes: each rank sends at most the bytes of its input pieces for the other ranks (each piece once, directly).
    """
    raise NotImplementedError
