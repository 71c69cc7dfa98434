"""Wrong on purpose: each micro-batch's loss is divided by m, and then the accumulated gradients are
divided by m again, as if they still had to be averaged over micro-batches."""

from __future__ import annotations

import torch
import torch.distributed as dist


def bubble_fraction(stages, micro_batches):
    if stages < 1 or micro_batches < 1:
        raise ValueError("stages and micro_batches must be positive")
    return (stages - 1) / (micro_batches + stages - 1)


def _order(schedule, p, s, m):
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(p - s - 1, m)
    events = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        events.append(("F", warmup + i))
        events.append(("B", i))
    events += [("B", i) for i in range(m - warmup, m)]
    return events


def pipeline_step(stage_module, inputs, targets, micro_batches, schedule, input_shape, loss_fn, group=None):
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"unknown schedule {schedule}")
    s, p = dist.get_rank(group), dist.get_world_size(group)
    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    weight = next(stage_module.parameters())
    m = micro_batches
    xs = inputs.chunk(m) if s == 0 else None
    ys = targets.chunk(m) if s == p - 1 else None
    saved, pending = {}, []
    total = torch.zeros((), dtype=weight.dtype, device=weight.device)
    for kind, i in _order(schedule, p, s, m):
        if kind == "F":
            if s == 0:
                x = xs[i]
            else:
                x = torch.empty(input_shape, dtype=weight.dtype, device=weight.device)
                dist.recv(x, peer(s - 1), group=group)
                x.requires_grad_()
            out = stage_module(x)
            if s == p - 1:
                loss = loss_fn(out, ys[i])
                total += loss.detach() / m
                out = loss / m
            else:
                sent = out.detach().contiguous()
                pending.append((dist.isend(sent, peer(s + 1), group=group), sent))
            saved[i] = (x, out)
        else:
            x, out = saved.pop(i)
            if s == p - 1:
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, peer(s + 1), group=group)
                out.backward(grad)
            if s > 0:
                sent = x.grad.contiguous()
                pending.append((dist.isend(sent, peer(s - 1), group=group), sent))
    for work, _ in pending:
        work.wait()
    for param in stage_module.parameters():
        if param.grad is not None:
            param.grad.div_(m)
    return total if s == p - 1 else None
