"""Grading parallel.zero2: data parallelism with gradients and optimizer state sharded over ranks.

The program `train_on_rank` runs inside each rank process with the student's ZeRO2, on its own inputs only (its
initial weights and its rows of the batch, built here): no rank can rebuild another's. The gradients each rank holds
after synchronisation, its weights after every step and its collectives come back here, and are compared with
single-process training by the unsharded optimizer on the full batch and with the pinned partition. In
test_process_group the world splits into groups (grader.ranks.subgroups), each training its own case.
"""

from __future__ import annotations

import gc

import torch
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_close, largest_magnitude
from grader.checks.outcomes import WrongAnswer
from grader.checks.profiles import on_ranks
from grader.checks.strategies import data_seeds
from grader.parallel.models import TiedMLP, check_module_kept, shard_mean_loss, tied_mlp_from_state
from grader.ranks import recorder
from grader.ranks.memory import MemoryProbe, allocated_bytes
from grader.ranks.rank import rank_device
from grader.ranks.rank_data import plain_state, row_shards, without_seeds
from grader.ranks.subgroups import group_case, inputs_by_group, join_group, rank_name, results_by_group
from grader.ranks.travel import check_parameters_travel
from grader.session.context import world_sizes

PROBLEM = BY_ID["parallel.zero2"]
STEPS = 3
# Rank r of a case starts from the weights of seed + r * RANK_SEED_STRIDE: far from subgroups.SEED_STRIDE, so that no
# rank of one group starts from the weights of a rank of another.
RANK_SEED_STRIDE = 101
OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


PARAMETER_NAMES = ("first.weight", "first.bias", "middle.weight", "middle.bias", "again.bias", "last.weight",
                   "last.bias")  # the order of model.parameters(); again.weight is middle.weight


def make_model(seed: int, config: dict, dtype: torch.dtype = torch.float32) -> TiedMLP:
    torch.manual_seed(seed)
    return TiedMLP(config["width"], config["hidden"], config["outputs"]).to(dtype)


def make_batch(config: dict, world_size: int, dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(config["seed"] + 1)
    rows = config["rows_per_rank"] * world_size
    x = torch.randn(rows, config["width"], generator=generator, dtype=torch.float64)
    y = torch.randn(rows, config["outputs"], generator=generator, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def rank_inputs(config: dict, world_size: int) -> list[dict]:
    """Each rank's own inputs, built in the grader's process: its initial weights and its rows of the batch. Each rank
    starts from different weights: only the broadcast at construction can make them agree."""
    x, y = make_batch(config, world_size)
    states = [plain_state(make_model(config["seed"] + RANK_SEED_STRIDE * rank, config)) for rank in range(world_size)]
    return row_shards(x, y, config["rows_per_rank"], states)


def run_training(ranks, world_size: int, config: dict) -> list[dict]:
    """train_on_rank on every rank, each given only its own inputs (with config["group_size"], its group's)."""
    group_size = config.get("group_size") or world_size
    return ranks.run(train_on_rank, world_size, without_seeds(config),
                     rank_data=inputs_by_group(config, world_size, group_size, rank_inputs))


def train_on_rank(student, rank: int, world_size: int, config: dict, rank_data: dict) -> dict:
    """Runs in a rank process: the student's ZeRO2 on this rank's rank_data (rank_inputs), every step recorded. With
    config["group_size"], the ranks form consecutive groups of that size, each an independent run (its own weights
    and data) with its own ZeRO2 over its group."""
    device = rank_device()
    group_size = config.get("group_size") or world_size
    group = join_group(rank, world_size, group_size) if group_size < world_size else None
    model = tied_mlp_from_state(rank_data["state"]).to(device)
    x_shard, y_shard = rank_data["x"].to(device), rank_data["y"].to(device)
    optimizer_cls, kwargs = OPTIMIZERS[config["optimizer"]]
    zero = student.ZeRO2(model, optimizer_cls, group=group, **kwargs)
    grads, weights, steps_calls, new_bytes = [], [], [], []
    for _ in range(STEPS):
        recorder.reset()
        # The probe counts what backward and the reduces leave alive, wherever it is kept: the gradients the rank
        # holds, or hidden copies of the others. Read before the grader's own copies of the gradients.
        with MemoryProbe(device) as memory:
            memory.start()
            loss = torch.nn.functional.mse_loss(zero(x_shard), y_shard)
            with recorder.phase("backward"):
                loss.backward()
            with recorder.phase("finish"):
                zero.finish_gradient_synchronization()
            calls = [(c.op, c.bytes, c.async_op, c.phase, c.waited, c.src) for c in recorder.CALLS]
            recorder.release_handles()  # the recorder's own references to the reduces' tensors
            gc.collect()  # and any cycle holding a freed gradient
            new_bytes.append(memory.settled_probe("after finish_gradient_synchronization()"))
        grads.append([None if p.grad is None else p.grad.detach().cpu().clone() for p in model.parameters()])
        with recorder.phase("step"):
            zero.step()
        zero.zero_grad()
        weights.append([p.detach().cpu().clone() for p in model.parameters()])
        steps_calls.append(calls + [(c.op, c.bytes, c.async_op, c.phase, c.waited, c.src)
                                    for c in recorder.CALLS[len(calls):] if not c.nested])
    return {"grads": grads, "weights": weights, "calls": steps_calls, "new_bytes": new_bytes,
            "device": str(device),
            "module_kept": getattr(zero, "module", None) is model}


def train_unsharded(config: dict, world_size: int, dtype: torch.dtype, shards: int = 1) -> dict:
    """Single-process training on the full batch with the unsharded optimizer, from rank 0's initial weights; the
    loss is the mean of `shards` row shards' losses (see shard_mean_loss)."""
    model = make_model(config["seed"], config, dtype)
    x, y = make_batch(config, world_size, dtype)
    optimizer_cls, kwargs = OPTIMIZERS[config["optimizer"]]
    optimizer = optimizer_cls([p for p in model.parameters() if p.requires_grad], **kwargs)
    grads, weights = [], []
    for _ in range(STEPS):
        shard_mean_loss(model, x, y, shards).backward()
        grads.append([None if p.grad is None else p.grad.detach().clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
        weights.append([p.detach().clone() for p in model.parameters()])
    return {"grads": grads, "weights": weights}


def pinned_owners(config: dict, world_size: int) -> list[int | None]:
    """The owner of each parameter (model.parameters() order; None if frozen): in order, to the rank holding the
    fewest elements so far, the lowest on a tie."""
    held, owners = [0] * world_size, []
    for param in make_model(0, config).parameters():
        if not param.requires_grad:
            owners.append(None)
            continue
        owner = min(range(world_size), key=lambda r: (held[r], r))
        held[owner] += param.numel()
        owners.append(owner)
    return owners


def parameter_bytes(config: dict) -> list[int]:
    return [p.numel() * p.element_size() for p in make_model(0, config).parameters()]


configs = st.fixed_dictionaries({
    "optimizer": st.sampled_from(tuple(OPTIMIZERS)),
    "seed": data_seeds(),
    "width": st.integers(3, 17),
    "hidden": st.integers(3, 17),
    "outputs": st.integers(1, 4),
    "rows_per_rank": st.integers(1, 5),
})


def check_training(results: list[dict], config: dict, ranks: int, group: int | None = None) -> None:
    """The owners' gradients after every synchronisation and every rank's weights after every step against
    single-process training of `config` on the full batch of `ranks` ranks (those of `group`, if given)."""
    exact = train_unsharded(config, ranks, torch.float64)
    at_fp32 = [train_unsharded(config, ranks, torch.float32, shards) for shards in (1, ranks)]
    owners = pinned_owners(config, ranks)
    tolerance = dict(multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps)
    owner_scope = "" if group is None else " of its group"
    for rank, result in enumerate(results):
        context = f"{rank_name(rank, ranks, group)}, {config}"
        for step in range(STEPS):
            for index, name in enumerate(PARAMETER_NAMES):
                if owners[index] != rank:
                    continue
                grad = result["grads"][step][index]
                if grad is None:
                    raise WrongAnswer(f"the gradient of {name} is None on its owner after "
                                      f"finish_gradient_synchronization() in step {step + 1} ({context})")
                assert_close(grad, exact["grads"][step][index],
                             tuple(run["grads"][step][index] for run in at_fp32),
                             what=f"gradient of {name} on its owner after step {step + 1}", context=context,
                             scale=largest_magnitude(exact["grads"][step]), **tolerance)
            for index, name in enumerate(PARAMETER_NAMES):
                assert_close(result["weights"][step][index], exact["weights"][step][index],
                             tuple(run["weights"][step][index] for run in at_fp32),
                             what=f"{name} (owned by rank {owners[index]}{owner_scope}) after step {step + 1}",
                             context=context, scale=largest_magnitude(exact["weights"][step]), **tolerance)


@on_ranks(PROBLEM, world_sizes(PROBLEM), config=configs)
def test_matches_single_process(ranks, world_size, config):
    check_training(run_training(ranks, world_size, config), config, world_size)


@on_ranks(PROBLEM, [2], config=configs)
def test_gradients_sharded(ranks, world_size, config):
    results = run_training(ranks, world_size, config)
    owners = pinned_owners(config, world_size)
    sizes = parameter_bytes(config)
    check_module_kept(results, "ZeRO2")
    for rank, result in enumerate(results):
        expected = sum(size for size, owner in zip(sizes, owners) if owner == rank)
        for step, grads in enumerate(result["grads"], start=1):
            held = [name for name, grad in zip(PARAMETER_NAMES, grads) if grad is not None]
            mine = [name for name, owner in zip(PARAMETER_NAMES, owners) if owner == rank]
            held_bytes = sum(g.numel() * g.element_size() for g in grads if g is not None)
            if held != mine:
                extra = [name for name in held if name not in mine]
                raise WrongAnswer(
                    f"rank {rank} of {world_size}, step {step}: after finish_gradient_synchronization() it holds "
                    f"gradients of {held} ({held_bytes} bytes); it owns {mine} ({expected} bytes)"
                    + (f": set the gradients of {extra}, which it does not own, to None" if extra else "")
                    + f" ({config})"
                )
        check_gradients_kept(result, sizes, owners, rank, f"rank {rank} of {world_size}, {config}")


def check_gradients_kept(result: dict, sizes: list[int], owners: list, rank: int, context: str) -> None:
    """Measured, not read from .grad: the bytes one step's backward and reduces leave alive on the rank (memory probe,
    from the second step on, when every buffer a solution reuses exists) are nearer its own gradients than every
    gradient. In-process evidence."""
    device = result["device"]
    owned = sum(allocated_bytes(size, device) for size, owner in zip(sizes, owners) if owner == rank)
    every = sum(allocated_bytes(size, device) for size, owner in zip(sizes, owners) if owner is not None)
    for step, kept in enumerate(result["new_bytes"][1:], start=2):
        if kept > (owned + every) / 2:
            raise WrongAnswer(f"{context}, step {step}: backward and finish_gradient_synchronization() left {kept} "
                              f"bytes of new tensors alive on this rank; its own gradients take {owned}, every "
                              f"gradient {every}: the rank keeps gradients (or copies) of parameters it does not own "
                              f"(a communication handle kept after its wait keeps its tensor alive too)")


@on_ranks(PROBLEM, [2], config=configs)
def test_collective_pattern(ranks, world_size, config):
    results = run_training(ranks, world_size, config)
    owners = pinned_owners(config, world_size)
    trainable = [size for size, owner in zip(parameter_bytes(config), owners) if owner is not None]
    for rank, result in enumerate(results):
        step_calls = [[(c[0], c[1], c[5]) for c in calls if c[3] == "step"] for calls in result["calls"]]
        check_parameters_travel(step_calls, parameter_bytes(config), owners, rank, f"rank {rank} ({config})")
        for step, calls in enumerate(result["calls"], start=1):
            where = f"rank {rank}, step {step} ({config})"
            all_reduces = [c for c in calls if c[0] == "all_reduce"]
            if all_reduces:
                raise WrongAnswer(f"{where}: {len(all_reduces)} all-reduces; ZeRO-2 reduces each gradient to its "
                                  "owner only (dist.reduce), so no rank ever holds the whole summed gradient")
            reduces = [c for c in calls if c[0] == "reduce"]
            if sorted(c[1] for c in reduces) != sorted(trainable):
                raise WrongAnswer(f"{where}: reduces of {sorted(c[1] for c in reduces)} bytes; expected one per "
                                  f"parameter that requires grad, {sorted(trainable)} bytes")
            late = [c for c in reduces if c[3] != "backward"]
            if late:
                raise WrongAnswer(f"{where}: {len(late)} reduces were issued after backward returned; issue each "
                                  "from its parameter's hook during backward")
            if any(not c[2] for c in reduces):
                raise WrongAnswer(f"{where}: blocking reduces; use async_op=True and wait in "
                                  "finish_gradient_synchronization()")
            if any(c[4] == "backward" for c in reduces):
                raise WrongAnswer(f"{where}: reduces were waited on during backward, so they did not overlap the "
                                  "rest of it; leave each in flight and wait in finish_gradient_synchronization()")


@on_ranks(PROBLEM, [4], config=configs)
def test_process_group(ranks, world_size, config):
    """Two independent pairs of ranks, {0, 1} and {2, 3}, each with its own weights, data and ZeRO2 over its own
    group: a ZeRO2 that broadcasts or reduces over the default group mixes the pairs' weights and gradients, and one
    that names a source or destination by its rank in the group, not its global rank, names a rank outside the pair
    {2, 3}."""
    config = {**config, "group_size": 2}
    for index, results in results_by_group(run_training(ranks, world_size, config), 2):
        check_training(results, group_case(config, index), 2, group=index)
