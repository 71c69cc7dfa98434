"""Pipeline parallelism: a model's layers split into stages, one per rank, trained on micro-batches with the GPipe
or the 1F1B schedule."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

SCHEDULES = ("gpipe", "1f1b")


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """(p - 1) / (m + p - 1): the share of a step's wall time each stage spends idle."""
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"need stages >= 1 and micro_batches >= 1, got {stages} and {micro_batches}")
    return (stages - 1) / (micro_batches + stages - 1)


def _schedule_order(schedule: str, stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """The (kind, micro-batch) events of `stage` in the order the schedule runs them; kind is "F" or "B"."""
    if schedule == "gpipe":
        return [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]
    # 1F1B: enough forwards to fill the pipeline below this stage, then one forward and one backward in turn, then
    # the backwards still owed. At most warmup + 1 = p - stage micro-batches are ever held by this stage.
    warmup = min(stages - stage - 1, micro_batches)
    order = [("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(micro_batches - warmup, micro_batches)]


def _global_rank(group: dist.ProcessGroup | None, stage: int) -> int:
    # send/recv address peers by their rank in the default group, whatever group they are issued on.
    return stage if group is None else dist.get_global_rank(group, stage)


def pipeline_step(
    stage_module: torch.nn.Module,
    inputs: Tensor | None,
    targets: Tensor | None,
    micro_batches: int,
    schedule: str,
    input_shape: tuple[int, ...],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    group: dist.ProcessGroup | None = None,
) -> Tensor | None:
    # Checked on every stage before any message, so that no stage is left waiting for a peer that has raised.
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if micro_batches < 1:
        raise ValueError(f"need micro_batches >= 1, got {micro_batches}")
    stage, stages = dist.get_rank(group), dist.get_world_size(group)
    first, last = stage == 0, stage == stages - 1
    parameter = next(stage_module.parameters())
    dtype, device = parameter.dtype, parameter.device

    def split(batch: Tensor) -> tuple[Tensor, ...]:
        if batch.shape[0] % micro_batches:
            raise ValueError(f"batch of {batch.shape[0]} rows does not split into {micro_batches} micro-batches")
        return batch.split(batch.shape[0] // micro_batches)

    inputs_mb = split(inputs) if first else None
    targets_mb = split(targets) if last else None
    previous = None if first else _global_rank(group, stage - 1)
    following = None if last else _global_rank(group, stage + 1)

    # Per micro-batch in flight: the stage's input (whose .grad goes back upstream) and its output (the loss on the
    # last stage), i.e. the autograd graph holding this stage's stored activations.
    in_flight: dict[int, tuple[Tensor, Tensor]] = {}
    # Sends are asynchronous so a stage never blocks on a peer that is itself sending; the tensors stay referenced
    # until their sends complete.
    sends: list[tuple[dist.Work, Tensor]] = []
    total_loss = torch.zeros((), dtype=dtype, device=device)

    def forward(i: int) -> None:
        nonlocal total_loss
        if first:
            x = inputs_mb[i]
        else:
            x = torch.empty(input_shape, dtype=dtype, device=device)
            dist.recv(x, previous, group=group)
            x.requires_grad_(True)
        y = stage_module(x)
        if last:
            # The micro-batch's mean loss divided by m: the sum over micro-batches is the full-batch mean loss.
            y = loss_fn(y, targets_mb[i]) / micro_batches
            total_loss += y.detach()
        else:
            activation = y.detach().contiguous()
            sends.append((dist.isend(activation, following, group=group), activation))
        in_flight[i] = (x, y)

    def backward(i: int) -> None:
        x, y = in_flight.pop(i)
        if last:
            y.backward()
        else:
            grad_y = torch.empty_like(y)
            dist.recv(grad_y, following, group=group)
            y.backward(grad_y)
        if not first:
            grad_x = x.grad.contiguous()
            sends.append((dist.isend(grad_x, previous, group=group), grad_x))

    for kind, i in _schedule_order(schedule, stages, stage, micro_batches):
        if kind == "F":
            forward(i)
        else:
            backward(i)
    for work, _ in sends:
        work.wait()
    return total_loss if last else None


def pipeline_step_torch(
    layers: list[torch.nn.Module], inputs: Tensor, targets: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor]
) -> Tensor:
    """The same gradients on one process: the whole model on the full batch, mean loss, one backward."""
    output = inputs
    for layer in layers:
        output = layer(output)
    loss = loss_fn(output, targets)
    loss.backward()
    return loss.detach()
