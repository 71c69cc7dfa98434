"""The model the data-parallel graders (bucketed DDP, ZeRO-1, ZeRO-2) train: small, but with every case a sharding
or bucketing rule must handle; and the loss every data-parallel grader's single-process training takes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from grader.checks.outcomes import WrongAnswer


class TiedMLP(torch.nn.Module):
    """first -> middle -> again -> last with tanh between: uneven widths, a frozen bias (first.bias), a weight tied
    between two layers (again.weight is middle.weight) and, with `input_scale`, a buffer that scales the input (so
    its broadcast matters). `before_last` is applied to the last layer's input (an identity with a backward hook,
    say)."""

    def __init__(self, width: int, hidden: int, outputs: int, input_scale: bool = True,
                 before_last: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.first = torch.nn.Linear(width, hidden)
        self.middle = torch.nn.Linear(hidden, hidden)
        self.again = torch.nn.Linear(hidden, hidden)
        self.again.weight = self.middle.weight
        self.last = torch.nn.Linear(hidden, outputs)
        self.first.bias.requires_grad_(False)
        self.register_buffer("input_scale", torch.rand(width) + 0.5 if input_scale else None)
        self.before_last = before_last

    def forward(self, x):
        hidden = torch.tanh(self.first(x if self.input_scale is None else x * self.input_scale))
        hidden = torch.tanh(self.again(torch.tanh(self.middle(hidden))))
        return self.last(hidden if self.before_last is None else self.before_last(hidden))


def tied_mlp_from_state(state: dict[str, torch.Tensor],
                        before_last: Callable[[torch.Tensor], torch.Tensor] | None = None) -> TiedMLP:
    """In a rank process: the TiedMLP whose widths, input-scale buffer (present or not), dtype and weights are those
    of `state` (a plain_state of one), on the CPU."""
    hidden, width = state["first.weight"].shape
    outputs = state["last.weight"].shape[0]
    model = TiedMLP(width, hidden, outputs, input_scale="input_scale" in state, before_last=before_last)
    model = model.to(state["first.weight"].dtype)
    model.load_state_dict(state)
    return model


def shard_mean_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, shards: int) -> torch.Tensor:
    """The full batch's mean squared error as the mean of `shards` equal row shards' errors. Equal in exact
    arithmetic for any `shards`; shards=world_size rounds as data-parallel ranks do, which makes its fp32 run a second
    legitimate yardstick beside the full batch's (shards=1)."""
    outputs = [model(x_shard) for x_shard in x.chunk(shards)]
    # Targets in the output's dtype: a float64 last layer's output meets float32 targets in bucketed DDP's mixed
    # model, which torch 2.11's mse_loss backward refuses.
    return sum(torch.nn.functional.mse_loss(output, y_shard.to(output.dtype))
               for output, y_shard in zip(outputs, y.chunk(shards))) / shards


def check_module_kept(results: list[dict], wrapper: str) -> None:
    """Each rank's `module_kept` (in the rank: `wrapper.module is model`): the contract pins `.module`, as torch's
    DistributedDataParallel has it, because code that unwraps a trained model reads it. In-process evidence."""
    for rank, result in enumerate(results):
        if not result["module_kept"]:
            raise WrongAnswer(f"rank {rank}: {wrapper}(module, ...).module is not the module given; keep it as "
                              "`self.module` (code that unwraps a trained model reads it)")
