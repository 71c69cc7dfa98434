"""Pipeline parallelism: a model's layers split into stages, one per rank, trained on micro-batches with the GPipe
or the 1F1B schedule."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist  # send/recv and isend/irecv live here
from torch import Tensor


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The fraction of a training step's wall time that each stage of a GPipe or 1F1B pipeline spends idle.

    Model: p = `stages` stages, m = `micro_batches` micro-batches; every stage takes the same time t_f for the
    forward and t_b for the backward of one micro-batch, and communication is free. A stage is busy m (t_f + t_b)
    per step; the step lasts (m + p - 1)(t_f + t_b), because the last micro-batch's forward reaches the last stage
    (p - 1) t_f after the first stage began it and its backward needs (p - 1) t_b more to come back. So

        bubble_fraction(p, m) = (p - 1)(t_f + t_b) / ((m + p - 1)(t_f + t_b)) = (p - 1) / (m + p - 1),

    the same for both schedules (1F1B changes memory, not the bubble). Return it as a Python float; it is checked
    against (p - 1) / (m + p - 1) to within 1e-12.

    Raises:
        ValueError: if stages < 1 or micro_batches < 1.
    """
    raise NotImplementedError


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
    """Run one training step's forward and backward passes of a pipeline stage, accumulating its gradients.

    Environment (set up by the caller, not by you):
      * torch.distributed is initialised. The pipeline is the process group `group` (None: the default group).
        Its p = dist.get_world_size(group) ranks are the stages; this rank is stage s = dist.get_rank(group).
        Point-to-point calls name their peer by its rank in the default group: stage s +- 1 is
        dist.get_global_rank(group, s +- 1) when a group is given, s +- 1 itself when group is None. Pass
        `group=group` to every call.
      * The model is a sequence of layers; the caller has given stage s a contiguous run of them as `stage_module`
        (stage 0 the first layers, stage p - 1 the last ones), already on this rank's device. Every stage has at
        least one parameter; some parameters may be frozen (requires_grad=False).
      * Every rank of the group calls pipeline_step with the same micro_batches and schedule.

    Arguments:
        stage_module: this stage's layers; call it as stage_module(x) exactly once per micro-batch in forward, and
            backpropagate through that output exactly once per micro-batch.
        inputs: on stage 0, the step's full batch of inputs [B, ...]; None on every other stage.
        targets: on stage p - 1, the full batch of targets [B, ...]; None on every other stage.
        micro_batches: m >= 1, dividing B. Micro-batch i is rows [i * B/m, (i + 1) * B/m) of inputs and targets.
        schedule: "gpipe" or "1f1b" (below).
        input_shape: the shape of one micro-batch's activation entering this stage, i.e. the shape stage s - 1's
            output has (on stage 0, the shape of a micro-batch of `inputs`). Receive into a tensor of this shape.
            Activations and their gradients have the dtype and device of the stage's parameters.
        loss_fn: loss_fn(output, target) returns the mean loss over one micro-batch (a 0-d tensor), e.g.
            torch.nn.functional.mse_loss. Call it only on stage p - 1, once per micro-batch.
        group: the pipeline's process group (None: the default group).

    Loss scaling (pinned): stage p - 1 backpropagates loss_fn(output_i, target_i) / m for micro-batch i. Since all
    micro-batches have B/m rows, the sum of these is the mean loss over the full batch, so when every stage has
    finished, each parameter's .grad has gained exactly the gradient of the full-batch mean loss: what one process
    computes with loss_fn(model(inputs), targets).backward(). Gradients accumulate into .grad (the caller zeroes
    them between steps); do not rescale them afterwards. Frozen parameters get no .grad.

    Schedules (pinned; the grader records the order in which stage_module's forward calls and the backward passes
    through its outputs happen on each stage, and requires exactly this order):
      * "gpipe": forwards of micro-batches 0, 1, ..., m - 1, then backwards of 0, 1, ..., m - 1.
      * "1f1b": with w = min(p - s - 1, m) warm-up forwards: forwards of micro-batches 0..w-1; then for
        i = 0, ..., m - w - 1: the forward of micro-batch w + i followed by the backward of micro-batch i; then
        the backwards of micro-batches m - w, ..., m - 1. So stage s never holds the activations of more than
        p - s micro-batches at once (the last stage alternates F, B from the start).
    Communication: in forward, stage s > 0 receives micro-batch i's activation from stage s - 1 and stage s < p - 1
    sends its output to stage s + 1; in backward, stage s < p - 1 receives the gradient of its output from stage
    s + 1 and stage s > 0 sends the gradient of its input to stage s - 1. Blocking send and recv between
    neighbours that both send first deadlock (in 1F1B, stage s sends an activation while stage s + 1 sends a
    gradient): use dist.isend for sends, keep the request and the sent tensor, and wait for all of them before
    returning.

    Overlap (checked): the stages must work at the same time. The grader times steps of 4 stages with m = 8, on
    the CPU over a gloo group of all the ranks (passed as `group`), each stage a layer whose forward sleeps 40 ms
    and whose backward sleeps 80 ms, from a barrier before pipeline_step to one after it. The bubble it measures,
    1 - m (t_f + t_b) / step time, must lie nearer (p - 1) / (m + p - 1) = 27 % than the 1 - 1/p = 75 % of stages
    that wait for the one before them to finish the whole batch, under both schedules.

    Returns:
        On stage p - 1: the full-batch mean loss, the sum over micro-batches of loss_fn(output_i, target_i) / m, as
        a detached 0-d tensor of loss_fn's dtype. On every other stage: None.

    Raises:
        ValueError: on every stage, before any message is sent, if schedule is not "gpipe" or "1f1b" or if
            micro_batches < 1; and, on the stages holding them, if m does not divide B.

    Do not use torch.distributed.pipelining or any other library's pipeline.
    """
    raise NotImplementedError
