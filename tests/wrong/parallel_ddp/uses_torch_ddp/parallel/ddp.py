"""Wrong on purpose: delegates to torch's own DistributedDataParallel, which the contract forbids."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel


class DDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        # Broadcasts at construction and all-reduces in buckets during backward.
        self.wrapped = DistributedDataParallel(module)

    def forward(self, *inputs, **kwargs):
        return self.wrapped(*inputs, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        # torch's DDP has already waited for its all-reduces when backward returns.
        pass
