"""Bucketed DDP's step time against its bucket size, measured over grader.parallel.link's simulated link.

The model is LAYERS layers, each a bias-free Linear(WIDTH, WIDTH) in float32 (exactly 0.25 MiB of gradient) followed
by an identity whose backward sleeps BACKWARD_S. Its gradients become final one layer every BACKWARD_S, last layer
first, and the link all-reduces a bucket in LATENCY_S plus 60 ms per MiB. Both are wall time that uses no core, so the
step time shows how the buckets overlap the backward, not how fast the machine is:
- small buckets pay the latency once per bucket and keep the link busier than the backward;
- one bucket of the whole model starts communicating only when the backward has finished.

A step is timed on each rank from a barrier before the forward to one after finish_gradient_synchronization(); the
fastest of TIMED_STEPS steps after WARMUP_STEPS is kept, and the slowest rank's time is the step's. The times are
taken in the rank processes, beside the student's code (in-process evidence).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from grader.parallel.bubble import Sleep
from grader.parallel.link import simulated_link_group

LAYERS, WIDTH, ROWS_PER_RANK = 8, 256, 4
BACKWARD_S = 0.020
WARMUP_STEPS, TIMED_STEPS = 1, 2


class SleepLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        return Sleep.apply(self.linear(x), 0.0, BACKWARD_S)


def step_ms_on_rank(student, rank: int, world_size: int, bucket_sizes_mb: list[float]) -> list[float]:
    """Runs in a rank process: per bucket size, the fastest step's wall time in ms on this rank."""
    # Two intra-op threads per rank on a two-core host spin against each other and add tens of ms at random.
    torch.set_num_threads(1)
    link = simulated_link_group()
    barrier_group = dist.new_group(backend="gloo")
    torch.manual_seed(rank)
    inputs = torch.randn(ROWS_PER_RANK, WIDTH)
    fastest = []
    for bucket_size_mb in bucket_sizes_mb:
        ddp = student.BucketedDDP(torch.nn.Sequential(*(SleepLayer() for _ in range(LAYERS))), bucket_size_mb,
                                  group=link)
        milliseconds = []
        for _ in range(WARMUP_STEPS + TIMED_STEPS):
            dist.barrier(group=barrier_group)
            started = time.perf_counter()
            ddp(inputs).square().mean().backward()
            ddp.finish_gradient_synchronization()
            dist.barrier(group=barrier_group)
            milliseconds.append((time.perf_counter() - started) * 1e3)
            ddp.module.zero_grad(set_to_none=True)
        fastest.append(min(milliseconds[WARMUP_STEPS:]))
    link.close()
    return fastest


def measured_step_ms(ranks, world_size: int, bucket_sizes_mb: list[float]) -> list[float]:
    """Per bucket size, the step time in ms: the longest any rank saw."""
    per_rank = ranks.run(step_ms_on_rank, world_size, bucket_sizes_mb)
    return [max(milliseconds[index] for milliseconds in per_rank) for index in range(len(bucket_sizes_mb))]
