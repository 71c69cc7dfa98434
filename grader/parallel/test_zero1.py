"""Grading parallel.zero1: an optimizer whose state is sharded over ranks, each rank stepping its own parameters.

The program `train_on_rank` runs inside each rank process: it averages gradients over its data-parallel ranks itself,
then calls the student's ShardedOptimizer. Each rank receives only its own inputs, built here (the initial weights and
its rows of the batch): no rank can rebuild another's rows. Weights after every step and the inner optimizer's state
come back here and are compared with single-process training by the unsharded optimizer on the full batch, and with
the pinned partition of parameters over ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import example
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_close, largest_magnitude
from grader.checks.outcomes import WrongAnswer
from grader.checks.profiles import on_ranks
from grader.checks.strategies import data_seeds
from grader.parallel.models import TiedMLP, shard_mean_loss, tied_mlp_from_state
from grader.ranks import recorder
from grader.ranks.memory import MemoryProbe, allocated_bytes
from grader.ranks.rank import rank_device
from grader.ranks.rank_data import plain_state, row_shards, without_seeds
from grader.ranks.subgroups import group_case, inputs_by_group, join_group, results_by_group
from grader.ranks.travel import check_parameters_travel
from grader.session.context import world_sizes

PROBLEM = BY_ID["parallel.zero1"]
STEPS = 3
OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
}


PARAMETER_NAMES = ("first.weight", "first.bias", "middle.weight", "middle.bias", "again.bias", "last.weight",
                   "last.bias")  # the order of model.parameters(); again.weight is middle.weight


def make_model(config: dict, dtype: torch.dtype = torch.float32) -> TiedMLP:
    torch.manual_seed(config["seed"])
    return TiedMLP(config["width"], config["hidden"], config["outputs"], input_scale=False).to(dtype)


def given_parameters(model: TiedMLP, config: dict) -> list[torch.Tensor]:
    """What the grader passes to ShardedOptimizer: every parameter, the tied weight a second time at the end; or, in
    the case "last_weight_only", one parameter, so that every rank but rank 0 of its group owns nothing."""
    if config.get("last_weight_only"):
        return [model.last.weight]
    return [*model.parameters(), model.again.weight]


def optimized_names(config: dict) -> tuple[str, ...]:
    """The names of the parameters the optimizer steps, in model.parameters() order."""
    return ("last.weight",) if config.get("last_weight_only") else PARAMETER_NAMES


def case_dtype(config: dict) -> torch.dtype:
    """The ranks' dtype: float32, or float64 in the one case where a placeholder in the default dtype must show."""
    return torch.float64 if config.get("float64") else torch.float32


def make_batch(config: dict, data_ranks: int, dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(config["seed"] + 1)
    rows = config["rows_per_rank"] * data_ranks
    x = torch.randn(rows, config["width"], generator=generator, dtype=torch.float64)
    y = torch.randn(rows, config["outputs"], generator=generator, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def state_tensor_bytes(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[list[int]]:
    """Bytes of each tensor in the optimizer's state, per parameter (in the order of `params`)."""
    return [[v.numel() * v.element_size() for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
            if p in optimizer.state else [] for p in params]


def state_bytes_by_parameter(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[int]:
    """Bytes of the tensors in the optimizer's state, per parameter (in the order of `params`)."""
    return [sum(v.numel() * v.element_size() for v in optimizer.state[p].values() if isinstance(v, torch.Tensor))
            if p in optimizer.state else 0 for p in params]


def rank_inputs(config: dict, world_size: int) -> list[dict]:
    """Each rank's own inputs, built in the grader's process: the initial weights (the same on every rank) and the
    rank's rows of the batch."""
    x, y = make_batch(config, world_size, case_dtype(config))
    return row_shards(x, y, config["rows_per_rank"], [plain_state(make_model(config, case_dtype(config)))] * world_size)


def train_on_rank(student, rank: int, world_size: int, config: dict, rank_data: dict) -> dict:
    """Runs in a rank process, on its own rank_data (rank_inputs). With config["group_size"], the ranks form
    consecutive groups of that size, each an independent data-parallel run (its own weights and data) with its own
    ShardedOptimizer over its group."""
    device = rank_device()
    group_size = config.get("group_size") or world_size
    group = join_group(rank, world_size, group_size) if group_size < world_size else None
    model = tied_mlp_from_state(rank_data["state"]).to(device)
    x_shard, y_shard = rank_data["x"].to(device), rank_data["y"].to(device)
    optimizer_cls, kwargs = OPTIMIZERS[config["optimizer"]]
    # A one-pass iterator, as model.parameters() is: the contract says "an iterable".
    sharded = student.ShardedOptimizer(iter(given_parameters(model, config)), optimizer_cls, group, **kwargs)
    params = list(model.parameters())
    not_given = [p for p in params if not any(p is q for q in given_parameters(model, config))]
    weights, state_bytes, state_held, new_bytes, step_calls = [], [], [], [], []
    for _ in range(STEPS):
        # The probe counts what the step leaves alive, wherever it is kept: state made by the first step, whether the
        # inner optimizer holds it or anything else does. It closes before the grader's own copies of the weights.
        with MemoryProbe(device) as memory:
            memory.start()
            torch.nn.functional.mse_loss(model(x_shard), y_shard).backward()
            for param in params:
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=group)
                    param.grad.div_(group_size)
            recorder.reset()
            with recorder.phase("step"):
                sharded.step()
            recorder.release_handles()  # a Work the recorder keeps keeps its tensors alive, which the probe would count
            step_calls.append([(c.op, c.bytes, c.src) for c in recorder.CALLS if not c.nested])
            sharded.zero_grad()
            for param in not_given:
                param.grad = None  # the optimizer's zero_grad clears only its own parameters' gradients
            new_bytes.append(memory.settled_probe("after the step"))
        weights.append([p.detach().cpu().clone() for p in params])
        inner = sharded.optimizer
        state_bytes.append(sum(state_bytes_by_parameter(inner, list(inner.state))))
        state_held.append([p in inner.state for p in params])
    optimized = [p for param_group in sharded.optimizer.param_groups for p in param_group["params"]]
    return {"weights": weights, "state_bytes": state_bytes, "state_held": state_held, "new_bytes": new_bytes,
            "step_calls": step_calls,
            "optimized": [(p.numel(), str(p.device), p.dtype) for p in optimized],
            "parameter_place": (str(params[0].device), params[0].dtype)}


def train_unsharded(config: dict, data_ranks: int, dtype: torch.dtype, shards: int = 1) -> dict:
    """Single-process training on the full batch with the unsharded optimizer; the loss is the mean of `shards` row
    shards' losses (see shard_mean_loss)."""
    model = make_model(config, dtype)
    x, y = make_batch(config, data_ranks, dtype)
    optimizer_cls, kwargs = OPTIMIZERS[config["optimizer"]]
    params = list(model.parameters())
    optimizer = optimizer_cls([p for name, p in model.named_parameters() if name in optimized_names(config)],
                              **kwargs)
    weights = []
    for _ in range(STEPS):
        shard_mean_loss(model, x, y, shards).backward()
        optimizer.step()
        optimizer.zero_grad()
        weights.append([p.detach().clone() for p in params])
    return {"weights": weights, "state_bytes": state_bytes_by_parameter(optimizer, params),
            "state_tensors": state_tensor_bytes(optimizer, params)}


def pinned_owners(config: dict, ranks: int) -> list[int]:
    """The rank of each parameter (in model.parameters() order; None if the optimizer is not given it): in order, to
    the rank holding the fewest elements so far, the lowest on a tie. The tied weight's second mention counts
    nothing."""
    held, owners = [0] * ranks, []
    for name, param in make_model(config).named_parameters():
        if name not in optimized_names(config):
            owners.append(None)
            continue
        owner = min(range(ranks), key=lambda r: (held[r], r))
        held[owner] += param.numel()
        owners.append(owner)
    return owners


def configs(optimizers=tuple(OPTIMIZERS)) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({
        "optimizer": st.sampled_from(optimizers),
        "seed": data_seeds(),
        "width": st.integers(3, 17),
        "hidden": st.integers(3, 17),
        "outputs": st.integers(1, 4),
        "rows_per_rank": st.integers(1, 5),
    })


def check_weights(results: list[dict], config: dict, data_ranks: int) -> None:
    exact = train_unsharded(config, data_ranks, torch.float64)
    at_dtype = [train_unsharded(config, data_ranks, case_dtype(config), shards) for shards in (1, data_ranks)]
    owners = pinned_owners(config, data_ranks)
    for rank, result in enumerate(results):
        context = f"rank {rank} of {len(results)}, {config}"
        for step in range(STEPS):
            scale = largest_magnitude(exact["weights"][step])
            for index, name in enumerate(PARAMETER_NAMES):
                assert_close(result["weights"][step][index], exact["weights"][step][index],
                             tuple(run["weights"][step][index] for run in at_dtype),
                             what=f"{name} ({owned_by(owners[index])}) after step {step + 1}",
                             context=context, multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps,
                             scale=scale)


def owned_by(owner: int | None) -> str:
    return "not given to the optimizer" if owner is None else f"owned by rank {owner} of its group"


def check_placeholder(result: dict, context: str) -> None:
    """A rank that owns no parameter: its inner optimizer holds one placeholder, a tensor of no elements on the
    device and in the dtype of the parameters (pinned: state or a step on another device must not appear). In-process
    evidence: the rank reports what its optimizer holds."""
    device, dtype = result["parameter_place"]
    if result["optimized"] != [(0, device, dtype)]:
        raise WrongAnswer(f"{context}: this rank owns no parameter, so its inner optimizer must hold one placeholder "
                          f"of 0 elements on {device} in {dtype}; it holds (elements, device, dtype) "
                          f"{result['optimized']}")


def run_training(ranks, world_size: int, config: dict) -> list[dict]:
    """train_on_rank on every rank, each given only its own inputs (with config["group_size"], its group's)."""
    group_size = config.get("group_size") or world_size
    return ranks.run(train_on_rank, world_size, without_seeds(config),
                     rank_data=inputs_by_group(config, world_size, group_size, rank_inputs))


@on_ranks(PROBLEM, world_sizes(PROBLEM), config=configs())
def test_matches_unsharded(ranks, world_size, config):
    check_weights(run_training(ranks, world_size, config), config, world_size)


@on_ranks(PROBLEM, [2], config=configs(("adamw", "sgd_momentum")))
@example(config={"optimizer": "adamw", "seed": 3, "width": 5, "hidden": 4, "outputs": 2, "rows_per_rank": 2,
                 "last_weight_only": True, "float64": True})  # ranks that own nothing (the placeholder's rule)
def test_state_sharded(ranks, world_size, config):
    results = run_training(ranks, world_size, config)
    unsharded_run = train_unsharded(config, world_size, case_dtype(config))
    unsharded = unsharded_run["state_bytes"]
    owners = pinned_owners(config, world_size)
    total = sum(unsharded)
    for rank, result in enumerate(results):
        expected = sum(b for b, owner in zip(unsharded, owners) if owner == rank)
        mine = [name for name, owner in zip(PARAMETER_NAMES, owners) if owner == rank]
        held = [name for name, has in zip(PARAMETER_NAMES, result["state_held"][-1]) if has]
        got = result["state_bytes"][-1]
        if got != expected or not set(held) <= set(mine):
            raise WrongAnswer(
                f"rank {rank} of {world_size}: its inner optimizer holds {got} bytes of state, for {held}; the pinned "
                f"partition gives it {mine}, {expected} bytes of the unsharded optimizer's {total}"
                + (" (it keeps the full state: step only the owned parameters)" if got >= total else "")
                + f" ({config})"
            )
        if rank not in owners:
            check_placeholder(result, f"rank {rank} of {world_size}, {config}")
        check_state_kept(result, unsharded_run["state_tensors"], owners, rank, f"rank {rank} of {world_size}, {config}")
        check_parameters_travel(result["step_calls"], parameter_bytes(config), owners, rank,
                                f"rank {rank} of {world_size}, {config}")


def parameter_bytes(config: dict) -> list[int]:
    """Bytes of each parameter, in model.parameters() order (the tied weight once)."""
    return [p.numel() * p.element_size() for p in make_model(config, case_dtype(config)).parameters()]


def check_state_kept(result: dict, state_tensors: list[list[int]], owners: list, rank: int, context: str) -> None:
    """Measured, not read from the attribute: the bytes the first step left alive on the rank (memory probe) are
    nearer the state of its own parameters than the state of every parameter. In-process evidence."""
    device = result["parameter_place"][0]
    owned = sum(allocated_bytes(b, device) for tensors, owner in zip(state_tensors, owners) if owner == rank
                for b in tensors)
    every = sum(allocated_bytes(b, device) for tensors in state_tensors for b in tensors)
    kept = result["new_bytes"][0]
    if kept > (owned + every) / 2:
        raise WrongAnswer(f"{context}: the first step left {kept} bytes of new tensors alive on this rank; the state "
                          f"of its own parameters takes {owned}, of every parameter {every}: the rank keeps optimizer "
                          f"state (or copies) for parameters it does not own")


@on_ranks(PROBLEM, [4], config=configs(("adamw",)))
def test_process_group(ranks, world_size, config):
    """Two independent pairs of ranks, {0, 1} and {2, 3}, each with its own weights, data and ShardedOptimizer over
    its own group: an optimizer that broadcasts over the default group mixes the pairs' weights."""
    config = {**config, "group_size": 2}
    for index, results in results_by_group(run_training(ranks, world_size, config), 2):
        check_weights(results, group_case(config, index), 2)
