"""Wrong on purpose: all_reduce calls the process group's own allreduce method, beneath torch.distributed's
functions, which the contract forbids as much as torch.distributed.all_reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist

REDUCE_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX)


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank that P2POp and send/recv address, of rank `group_rank` of `group`."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _exchange(group, send: torch.Tensor | None = None, dst: int = 0, recv: torch.Tensor | None = None,
              src: int = 0) -> None:
    """Send `send` to group rank `dst` and receive `recv` from group rank `src`, both at once, and wait.

    Empty tensors are not sent: both ends know every size, so both skip them alike.
    """
    ops = []
    if send is not None and send.numel() > 0:
        ops.append(dist.P2POp(dist.isend, send, _global(group, dst), group))
    if recv is not None and recv.numel() > 0:
        ops.append(dist.P2POp(dist.irecv, recv, _global(group, src), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _combine(op, accumulator: torch.Tensor, incoming: torch.Tensor) -> None:
    if op == dist.ReduceOp.SUM:
        accumulator.add_(incoming)
    else:
        torch.maximum(accumulator, incoming, out=accumulator)


def _check_rank(name: str, value: int, world_size: int) -> None:
    if not 0 <= value < world_size:
        raise ValueError(f"{name}={value} is not a rank of a group of {world_size}")


def _check_op(op) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"unsupported reduction {op}: only ReduceOp.SUM and ReduceOp.MAX")


def _check_list(name: str, tensors, world_size: int, like: torch.Tensor | None = None) -> None:
    if tensors is None or len(tensors) != world_size:
        raise ValueError(f"{name} must hold one tensor per rank ({world_size}), got "
                         f"{'None' if tensors is None else len(tensors)}")
    for index, t in enumerate(tensors):
        if like is not None and (t.shape != like.shape or t.dtype != like.dtype):
            raise ValueError(f"{name}[{index}] has shape {tuple(t.shape)} and {t.dtype}; expected "
                             f"{tuple(like.shape)} and {like.dtype}")


def _lowest_set_bit(v: int) -> int:
    return v & -v


def _tree_children(v: int, world_size: int) -> list[int]:
    """Children of relative rank v in a binomial tree rooted at 0: v + m for the powers of two m below v's lowest
    set bit (below world_size for the root), smallest subtree first."""
    limit = _lowest_set_bit(v) if v else 1 << max(world_size - 1, 0).bit_length()
    children, m = [], 1
    while m < limit and v + m < world_size:
        children.append(v + m)
        m <<= 1
    return children


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    rank, world_size = _rank_and_size(group)
    _check_rank("src", src, world_size)
    # Binomial tree: ceil(log2 N) rounds instead of N - 1 sends from the root, and still every rank but src
    # receives the tensor exactly once, so (N - 1) * B bytes cross the network in all.
    v = (rank - src) % world_size
    if v:
        _exchange(group, recv=tensor, src=(v - _lowest_set_bit(v) + src) % world_size)
    for child in reversed(_tree_children(v, world_size)):  # largest subtree first: it has the most to forward
        _exchange(group, send=tensor, dst=(child + src) % world_size)


def reduce(tensor: torch.Tensor, dst: int, op=dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> None:
    rank, world_size = _rank_and_size(group)
    _check_rank("dst", dst, world_size)
    _check_op(op)
    # The broadcast tree run backwards: fold in each child's partial result, then pass ours to the parent. Every
    # rank but dst sends one tensor, and `tensor` itself is the accumulator (its contents off dst are unspecified).
    v = (rank - dst) % world_size
    incoming = torch.empty_like(tensor)
    for child in _tree_children(v, world_size):
        _exchange(group, recv=incoming, src=(child + dst) % world_size)
        _combine(op, tensor, incoming)
    if v:
        _exchange(group, send=tensor, dst=(v - _lowest_set_bit(v) + dst) % world_size)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group: dist.ProcessGroup | None = None) -> None:
    rank, world_size = _rank_and_size(group)
    _check_rank("src", src, world_size)
    if rank != src:
        _exchange(group, recv=tensor, src=src)
        return
    _check_list("scatter_list", scatter_list, world_size, like=tensor)
    ops = [dist.P2POp(dist.isend, piece, _global(group, i), group)
           for i, piece in enumerate(scatter_list) if i != src and piece.numel() > 0]
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    tensor.copy_(scatter_list[src])


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group: dist.ProcessGroup | None = None) -> None:
    rank, world_size = _rank_and_size(group)
    _check_rank("dst", dst, world_size)
    if rank != dst:
        _exchange(group, send=tensor, dst=dst)
        return
    _check_list("gather_list", gather_list, world_size, like=tensor)
    ops = [dist.P2POp(dist.irecv, piece, _global(group, i), group)
           for i, piece in enumerate(gather_list) if i != dst and piece.numel() > 0]
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    gather_list[dst].copy_(tensor)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    rank, world_size = _rank_and_size(group)
    _check_list("tensor_list", tensor_list, world_size, like=tensor)
    tensor_list[rank].copy_(tensor)
    # Ring: at step k every rank forwards the piece it received at step k - 1 (its own at step 0), so after N - 1
    # steps each has every piece and has sent (N - 1) pieces.
    for step in range(world_size - 1):
        _exchange(group, send=tensor_list[(rank - step) % world_size], dst=(rank + 1) % world_size,
                  recv=tensor_list[(rank - step - 1) % world_size], src=(rank - 1) % world_size)


def _ring_reduce_scatter(chunks: list[torch.Tensor], op, rank: int, world_size: int, group) -> None:
    """In place on the chunks of a flat buffer: afterwards chunks[rank] holds the reduction over ranks.

    At step k rank r passes its partial sum of chunk r-k-1 to r+1 and adds r-1's partial sum of chunk r-k-2 to its
    own; after N - 1 steps the chunk it last added to is chunk r, now holding all N contributions.
    """
    incoming = torch.empty_like(chunks[0])  # chunk 0 is the largest of a tensor_split
    for step in range(world_size - 1):
        receive = (rank - step - 2) % world_size
        buffer = incoming[: chunks[receive].numel()]
        _exchange(group, send=chunks[(rank - step - 1) % world_size], dst=(rank + 1) % world_size,
                  recv=buffer, src=(rank - 1) % world_size)
        _combine(op, chunks[receive], buffer)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                   group: dist.ProcessGroup | None = None) -> None:
    rank, world_size = _rank_and_size(group)
    _check_op(op)
    chunk_sizes = [c.numel() for c in torch.empty(input.numel(), device="meta").tensor_split(world_size)]
    if output.dim() != 1 or output.numel() != chunk_sizes[rank] or output.dtype != input.dtype:
        raise ValueError(f"output must be a 1-D {input.dtype} tensor of {chunk_sizes[rank]} elements (chunk {rank} "
                         f"of {input.numel()} split {world_size} ways), got {tuple(output.shape)} {output.dtype}")
    work = input.flatten().clone()  # the input is left unchanged
    _ring_reduce_scatter(list(work.tensor_split(world_size)), op, rank, world_size, group)
    output.copy_(work.tensor_split(world_size)[rank])


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> None:
    rank, world_size = _rank_and_size(group)
    _check_op(op)
    # Reduce-scatter then all-gather, both rings over the same chunks: each phase sends N - 1 chunks of about B / N
    # bytes, 2 (N - 1) / N * B in all, whatever N, where a reduce to one rank then a broadcast sends (N - 1) * B
    # from the root.
    options = dist.AllreduceOptions()
    options.reduceOp = op
    (group if group is not None else dist.group.WORLD).allreduce([tensor], options).wait()


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: dist.ProcessGroup | None = None) -> None:
    rank, world_size = _rank_and_size(group)
    _check_list("output_tensor_list", output_tensor_list, world_size)
    _check_list("input_tensor_list", input_tensor_list, world_size)
    # Every pair exchanges directly, all messages in one batch: with uneven sizes there is no common step to
    # pipeline, and each byte crosses the network once.
    ops = []
    for peer in range(world_size):
        if peer == rank:
            continue
        if input_tensor_list[peer].numel():
            ops.append(dist.P2POp(dist.isend, input_tensor_list[peer], _global(group, peer), group))
        if output_tensor_list[peer].numel():
            ops.append(dist.P2POp(dist.irecv, output_tensor_list[peer], _global(group, peer), group))
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    output_tensor_list[rank].copy_(input_tensor_list[rank])
