"""What the ranks of a launch are given (see `Ranks.run`): the arguments every rank sees, and each rank's own inputs,
built in the grader's process and delivered to that rank alone."""

from __future__ import annotations

import torch

# The seeds a case's data is drawn from: a rank told them could rebuild every other rank's inputs.
SEED_KEYS = ("seed", "dropout_seed")


def without_seeds(config: dict) -> dict:
    """A case as every rank may see it: its shapes and options, not the seeds of its data."""
    return {key: value for key, value in config.items() if key not in SEED_KEYS}


def plain_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers as CPU tensors of their own: initial weights for one rank."""
    return {name: value.detach().cpu().clone() for name, value in model.state_dict().items()}


def row_shards(x: torch.Tensor, y: torch.Tensor, rows_per_rank: int, states: list[dict]) -> list[dict]:
    """Rank r's {"x", "y", "state"}: its rows of the batch and states[r]. The rows are copied: a slice sent as it is
    would carry the whole batch's storage, every other rank's rows included."""
    shards = []
    for rank, state in enumerate(states):
        first = rank * rows_per_rank
        rows = slice(first, first + rows_per_rank)
        shards.append({"x": x[rows].clone(), "y": y[rows].clone(), "state": state})
    return shards


def integer_tensor(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Small integers as float32: every sum of a few of them is exact, whatever the order."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=generator).float()
