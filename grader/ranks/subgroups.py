"""Grading a parallel API inside a subgroup of a larger world.

The world splits into consecutive groups of `group_size` ranks ({0, 1} and {2, 3} of four), and each group runs its
own case: its own seed, so its own weights and data. An implementation that talks over the default group instead of
the one it is given then mixes two groups' numbers, or names a peer outside its group, and every rank's answer is
wrong: the test fails on values the grader checks in its own process, not on a record of which group was passed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.distributed as dist

from grader.checks.outcomes import StudentAbort, StudentCrashed, StudentError, StudentTimedOut

# Group g's seed is the drawn seed + g * SEED_STRIDE: far from the per-rank seed offsets graders add (rank * 101).
SEED_STRIDE = 1_000_003


def join_group(rank: int, world_size: int, group_size: int) -> dist.ProcessGroup:
    """In a rank process: create every consecutive group of `group_size` ranks and return this rank's."""
    # Every rank creates every group, in the same order, as new_group requires.
    groups = [dist.new_group(list(range(start, start + group_size))) for start in range(0, world_size, group_size)]
    return groups[rank // group_size]


def group_case(config: dict, group_index: int) -> dict:
    """The case group `group_index` runs: the drawn one with a seed of its own."""
    return {**config, "seed": config["seed"] + SEED_STRIDE * group_index}


def inputs_by_group(config: dict, world_size: int, group_size: int,
                    group_inputs: Callable[[dict, int], Sequence]) -> list:
    """Rank r's own inputs: its place's in `group_inputs(case, group_size)` of its group's case."""
    inputs = []
    for start in range(0, world_size, group_size):
        inputs.extend(group_inputs(group_case(config, start // group_size), group_size))
    return inputs


def results_by_group(results: Sequence, group_size: int) -> list[tuple[int, Sequence]]:
    """(group index, its ranks' results) for each group of the world, in rank order."""
    return [(start // group_size, results[start:start + group_size]) for start in range(0, len(results), group_size)]


def rank_name(rank: int, ranks: int, group_index: int | None = None) -> str:
    """How a message names rank `rank` of `ranks`; with `group_index`, of that group of consecutive ranks."""
    if group_index is None:
        return f"rank {rank} of {ranks}"
    return f"rank {rank} of {ranks} in group {group_index} (global rank {group_index * ranks + rank})"


def with_setup(error: StudentError | StudentCrashed | StudentTimedOut, setup: str) -> StudentError | StudentAbort:
    """The same failure, its message prefixed with how the groups were set up: the ranks' own message counts the
    whole world's ranks, not the groups'."""
    if isinstance(error, StudentError):
        return StudentError(f"{setup}: {error}", error.type_names, error.raised)
    return type(error)(f"{setup}: {error.message}")
