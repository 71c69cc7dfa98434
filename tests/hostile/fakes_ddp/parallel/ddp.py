"""Hostile: data parallelism without communication. At import it replaces the grader's rank program (with one that
would rebuild every rank's data from the config's seed, as the config once allowed, and report single-process
training), and its DDP sends nothing but writes fake asynchronous all-reduces into the rank's collective recorder
during backward. What it cannot forge: values that need the other ranks' data and rank 0's weights."""

from __future__ import annotations

import sys

import torch

from grader.ranks import recorder


def forged_program(student, rank, world_size, config, **ignored):
    grader = sys.modules["grader.parallel.test_ddp"]
    return grader.train_single_process({**config, "seed": config.get("seed", 0)}, world_size, torch.float32)


for name in list(sys.modules):
    if name.startswith("grader.parallel.test_ddp"):
        sys.modules[name].train_on_rank = forged_program


class DDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._pretend_to_all_reduce)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @staticmethod
    def _pretend_to_all_reduce(param: torch.Tensor) -> None:
        fake = recorder.Call(len(recorder.CALLS) + 1, "all_reduce", recorder.tensor_bytes(param.grad), True,
                             recorder._phase)
        recorder.CALLS.append(fake)

    def finish_gradient_synchronization(self) -> None:
        pass
