"""Grading parallel.fsdp: parameters sharded per unit, gathered around each unit's forward and backward.

The program `train_on_rank` runs inside each rank process with the student's module: it wraps a stack of blocks (one
unit per block), trains a few steps on the rank's rows, and returns the shards, their gradients, the collectives of
each step and, when asked, the rank's peak tensor bytes during a step (grader.ranks.memory). A rank receives
only its own inputs, built here (the initial weights and its rows of the batch): no rank can rebuild another's rows.
Everything is compared here against single-process training on the full batch. In test_process_group the world splits
into groups (grader.ranks.subgroups), each training its own case.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_close, largest_magnitude
from grader.checks.marks import multi_gpu
from grader.checks.outcomes import WrongAnswer
from grader.checks.profiles import on_ranks
from grader.checks.strategies import data_seeds
from grader.parallel.models import shard_mean_loss
from grader.ranks import recorder
from grader.ranks.memory import MemoryProbe, probe_point
from grader.ranks.raised import not_raising, raised_by
from grader.ranks.rank import rank_device
from grader.ranks.rank_data import plain_state, row_shards, without_seeds
from grader.ranks.step_time import grade_step_time, time_steps, weight_sums
from grader.ranks.subgroups import group_case, inputs_by_group, join_group, rank_name, results_by_group
from grader.session.context import world_sizes

PROBLEM = BY_ID["parallel.fsdp"]
STEPS = 3
LEARNING_RATE = 0.05
MEMORY_UNITS = 8  # the memory test's stack: keeping every unit gathered costs twice what is allowed
ALL_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single")
REDUCE_SCATTERS = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")
DTYPES = {None: torch.float32, "bfloat16": torch.bfloat16}
# The "frozen" variant's parameters with requires_grad=False: block1 keeps one trainable parameter.
FROZEN = ("block0.second.weight", "block1.first.weight", "block1.first.bias", "block1.second.bias")


class Block(torch.nn.Module):
    """second(tanh(first(x))), memory probed between the two layers (while the unit's parameters are gathered).
    With also_rows it returns (that, its row count as an int64 tensor): a unit output that needs no gradient. Its
    second argument, the row count as an int64 tensor, must reach it as it was given: only floating-point arguments
    are cast to compute_dtype."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.first = torch.nn.Linear(d_in, d_out)
        self.second = torch.nn.Linear(d_out, d_out)
        self.memory: MemoryProbe | None = None
        self.where = ""
        self.also_rows = False

    def forward(self, x, rows=None):
        if rows is not None and rows.dtype != torch.int64:
            raise TypeError(f"{self.where} received its int64 row count as {rows.dtype}: only a unit's floating-point "
                            "arguments are cast to compute_dtype")
        y = self.second(probe_point(torch.tanh(self.first(x)), self.memory, f"inside {self.where}"))
        return (y, torch.full((), x.shape[0], device=x.device)) if self.also_rows else y


class Stack(torch.nn.Module):
    """Blocks registered as direct children (the units), tanh between them. The "frozen" variant freezes
    block0.second.weight and all of block1 but its second.weight (a unit of one trainable parameter), and its
    block1 also returns its row count (an output that needs no gradient)."""

    def __init__(self, widths: list[int], variant: str):
        super().__init__()
        self.count = len(widths) - 1
        for index in range(self.count):
            self.add_module(f"block{index}", Block(widths[index], widths[index + 1]))
        if variant == "frozen":
            for name in FROZEN:
                self.get_parameter(name).requires_grad_(False)
            self.block1.also_rows = True
        if variant == "tied":
            self.block2.second.weight = self.block0.second.weight
        self.memory: MemoryProbe | None = None

    def attach(self, memory: MemoryProbe | None) -> None:
        self.memory = memory
        for index in range(self.count):
            block = getattr(self, f"block{index}")
            block.memory, block.where = memory, f"block{index}"

    def forward(self, x):
        for index in range(self.count):
            x = getattr(self, f"block{index}")(x, torch.full((), x.shape[0], device=x.device))
            x = x[0] if isinstance(x, tuple) else x
            if index < self.count - 1:
                x = probe_point(torch.tanh(x), self.memory, f"after block{index}")
        return x


def make_model(config: dict, dtype: torch.dtype = torch.float32) -> Stack:
    torch.manual_seed(config["seed"])
    return Stack(config["widths"], config["variant"]).to(dtype)


def make_batch(config: dict, world_size: int, dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(config["seed"] + 1)
    rows = config["rows_per_rank"] * world_size
    x = torch.randn(rows, config["widths"][0], generator=generator, dtype=torch.float64)
    y = torch.randn(rows, config["widths"][-1], generator=generator, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def make_optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=0.1)
    return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=0.9)


def rank_inputs(config: dict, world_size: int) -> list[dict]:
    """Each rank's own inputs, built in the grader's process: the initial weights (the same on every rank) and the
    rank's rows of the batch."""
    x, y = make_batch(config, world_size)
    return row_shards(x, y, config["rows_per_rank"], [plain_state(make_model(config))] * world_size)


def train_on_rank(student, rank: int, world_size: int, config: dict, rank_data: dict) -> dict:
    """Runs in a rank process: the student's FSDP on this rank's rank_data (rank_inputs), every step recorded. With
    config["group_size"], the ranks form consecutive groups of that size, each an independent run (its own weights
    and data) with its own FSDP over its group."""
    device = rank_device()
    group_size = config.get("group_size") or world_size
    group = join_group(rank, world_size, group_size) if group_size < world_size else None
    x_shard, y_shard = rank_data["x"].to(device), rank_data["y"].to(device)
    measure = config.get("measure_memory", False)
    result = {"grads": [], "calls": [], "peaks": [], "held_between_steps": []}
    # Opened before the model is built, so that every storage the model and the wrapper create is seen.
    with MemoryProbe(device) as memory:
        model = Stack(config["widths"], config["variant"])
        model.load_state_dict(rank_data["state"])
        model = model.to(device)
        if measure:
            # What the plain model's forward keeps for backward: the activations' share of the allowance.
            memory.start()
            activations = model(x_shard)
            result["activation_bytes"] = memory.probe("plain forward")
            del activations
            model.attach(memory)
        fsdp = student.FSDP(model, compute_dtype=DTYPES[config.get("compute_dtype")], group=group)
        shards = fsdp.sharded_parameters()
        # Copies the checks need would count as held memory: the memory test keeps none.
        record = not measure
        result["shards_at_construction"] = [s.detach().cpu().clone() for s in shards] if record else []
        optimizer = make_optimizer(config["optimizer"], list(shards))
        for step in range(STEPS):
            recorder.reset()
            if measure and step > 0:  # after the first step the gradients and optimizer state exist: the baseline
                memory.start()
                result["held_between_steps"].append(memory.baseline)
            with recorder.phase("forward"):
                output = fsdp(x_shard)
            memory.probe("after forward")
            loss = torch.nn.functional.mse_loss(output.float(), y_shard)
            with recorder.phase("backward"):
                loss.backward()
            memory.probe("after backward")
            if measure and step > 0:
                result["peaks"].append(memory.peak_above_start())
            del output, loss
            if record:
                result["grads"].append([None if s.grad is None else s.grad.detach().cpu().clone() for s in shards])
            result["calls"].append([(c.op, c.bytes, c.phase) for c in recorder.CALLS if not c.nested])
            optimizer.step()
            optimizer.zero_grad(set_to_none=not measure)
    result["final_shards"] = [s.detach().cpu().clone() for s in shards]
    result["state_dict"] = {k: v.detach().cpu().clone() for k, v in fsdp.full_state_dict().items()}
    return result


def construct_on_rank(student, rank: int, world_size: int, config: dict) -> dict:
    """Runs in a rank process: construct the student's FSDP and report what it raised, if anything (no data: the
    config's seed only sets the initial weights, which every rank shares)."""
    return raised_by({"FSDP": lambda: student.FSDP(make_model(config).to(rank_device()))})


def run_training(ranks, world_size: int, config: dict, reference: bool = False) -> list[dict]:
    """train_on_rank on every rank (with the reference's module if `reference`), each given only its own inputs (with
    config["group_size"], its group's)."""
    launch = ranks.run_reference if reference else ranks.run
    group_size = config.get("group_size") or world_size
    return launch(train_on_rank, world_size, without_seeds(config),
                  rank_data=inputs_by_group(config, world_size, group_size, rank_inputs))


# --- the expected values ------------------------------------------------------------------------------------------


def units(model: Stack) -> list[tuple[str, list[tuple[str, torch.Tensor]]]]:
    """(unit name, its trainable (name, parameter) pairs in flat order) for every child with a trainable parameter."""
    found = []
    for name, child in model.named_children():
        trainable = [(f"{name}.{n}", p) for n, p in child.named_parameters() if p.requires_grad]
        if trainable:
            found.append((name, trainable))
    return found


def padded_numel(params: list, world_size: int) -> int:
    return math.ceil(sum(p.numel() for _, p in params) / world_size) * world_size


def shard_of(tensors: list[torch.Tensor], world_size: int, rank: int) -> torch.Tensor:
    """Rank's shard of the zero-padded concatenation of `tensors`."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    padded = math.ceil(flat.numel() / world_size) * world_size
    flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
    size = padded // world_size
    return flat[rank * size : (rank + 1) * size]


def train_single_process(config: dict, world_size: int, dtype: torch.dtype, shards: int = 1) -> dict:
    """The same training on one process over the full batch; the loss is the mean of `shards` row shards' losses
    (see shard_mean_loss)."""
    model = make_model(config, dtype)
    x, y = make_batch(config, world_size, dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(config["optimizer"], trainable)
    per_unit = units(model)
    result = {"initial": {n: p.detach().clone() for n, p in model.named_parameters()}, "grads": []}
    for _ in range(STEPS):
        # The mean over the full batch equals the mean over ranks of equal-sized shard means.
        shard_mean_loss(model, x, y, shards).backward()
        result["grads"].append([[p.grad.clone() for _, p in params] for _, params in per_unit])
        optimizer.step()
        optimizer.zero_grad()
    result["final"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    result["unit_params"] = [[n for n, _ in params] for _, params in per_unit]
    return result


# --- checks -------------------------------------------------------------------------------------------------------


def check_shard(actual, exact: torch.Tensor, at_dtype, what: str, context: str,
                multiple: float = PROBLEM.error_multiple, scale: float | None = None) -> None:
    if actual is None:
        raise WrongAnswer(f"{what} is None ({context})")
    assert_close(actual, exact, at_dtype, what=what, context=context, multiple=multiple,
                 floor_ulps=PROBLEM.floor_ulps, scale=scale)


def check_shards_at_construction(results: list[dict], config: dict, world_size: int, group: int | None = None) -> None:
    model = make_model(config)
    per_unit = units(model)
    for rank, result in enumerate(results):
        where = rank_name(rank, world_size, group)
        got = result["shards_at_construction"]
        if len(got) != len(per_unit):
            raise WrongAnswer(f"{where}: sharded_parameters() returned {len(got)} shards for {len(per_unit)} units")
        for (name, params), shard in zip(per_unit, got):
            want = shard_of([p for _, p in params], world_size, rank)
            if shard.shape != want.shape or not torch.equal(shard, want):
                raise WrongAnswer(
                    f"{where}: the shard of unit {name} after construction is not elements "
                    f"[{rank} * S, {rank + 1} * S) of the unit's zero-padded flat parameter (S = {want.numel()}, "
                    f"got {tuple(shard.shape)} elements) ({config})"
                )


def check_training(results: list[dict], config: dict, world_size: int, reference_results: list[dict] | None = None,
                   multiple: float = PROBLEM.error_multiple, group: int | None = None) -> None:
    """Every rank's gradient shards and final shards against single-process training (float64 exact; float32, or
    the reference's run with the same compute dtype, for the tolerance). Against float32 runs, the floor's scale is
    the whole model's (compare.py); a lower-precision calibration keeps each shard's own. With `group`, `results`
    are that group's ranks, `world_size` of them."""
    exact = train_single_process(config, world_size, torch.float64)
    at_fp32 = ([] if reference_results is not None  # the calibration runs stand in for them
               else [train_single_process(config, world_size, torch.float32, shards) for shards in (1, world_size)])
    names = [name for name, _ in units(make_model(config))]
    for rank, result in enumerate(results):
        context = f"{rank_name(rank, world_size, group)}, {config}"
        calibration = reference_results[rank] if reference_results is not None else None
        for step in range(STEPS):
            scale = None if calibration is not None else largest_magnitude(
                [grad for unit in exact["grads"][step] for grad in unit])
            for index, name in enumerate(names):
                want64 = shard_of(exact["grads"][step][index], world_size, rank)
                want = (calibration["grads"][step][index] if calibration is not None
                        else tuple(shard_of(run["grads"][step][index], world_size, rank) for run in at_fp32))
                check_shard(result["grads"][step][index], want64, want,
                            f"gradient shard of unit {name} in step {step + 1}", context, multiple, scale)
        scale = None if calibration is not None else largest_magnitude(list(exact["final"].values()))
        for index, name in enumerate(names):
            params = exact["unit_params"][index]
            want64 = shard_of([exact["final"][n] for n in params], world_size, rank)
            want = (calibration["final_shards"][index] if calibration is not None
                    else tuple(shard_of([run["final"][n] for n in params], world_size, rank) for run in at_fp32))
            check_shard(result["final_shards"][index], want64, want, f"shard of unit {name} after {STEPS} steps",
                        context, multiple, scale)


widths = st.lists(st.integers(2, 11), min_size=4, max_size=4)
configs = st.fixed_dictionaries({
    "seed": data_seeds(),
    "widths": widths,
    "rows_per_rank": st.integers(1, 4),
    "optimizer": st.sampled_from(["sgd", "adamw"]),
})


@on_ranks(PROBLEM, world_sizes(PROBLEM), config=configs)
def test_matches_single_process(ranks, world_size, config):
    config = {**config, "variant": "plain"}
    results = run_training(ranks, world_size, config)
    check_shards_at_construction(results, config, world_size)
    check_training(results, config, world_size)


@on_ranks(PROBLEM, [2], config=configs)
def test_frozen_parameter(ranks, world_size, config):
    config = {**config, "variant": "frozen"}
    results = run_training(ranks, world_size, config)
    check_shards_at_construction(results, config, world_size)
    check_training(results, config, world_size)
    initial = make_model(config).state_dict()
    for rank, result in enumerate(results):
        for name in FROZEN:
            got = result["state_dict"].get(name)
            if got is None or not torch.equal(got, initial[name]):
                raise WrongAnswer(f"rank {rank}: the frozen parameter {name} is missing from full_state_dict() or "
                                  f"changed during training; it must stay as it was ({config})")


@on_ranks(PROBLEM, [2], config=configs)
def test_full_state_dict(ranks, world_size, config):
    config = {**config, "variant": "plain"}
    results = run_training(ranks, world_size, config)
    exact = train_single_process(config, world_size, torch.float64)
    at_fp32 = [train_single_process(config, world_size, torch.float32, shards) for shards in (1, world_size)]
    scale = largest_magnitude(list(exact["final"].values()))
    for rank, result in enumerate(results):
        got = result["state_dict"]
        if set(got) != set(exact["final"]):
            raise WrongAnswer(f"rank {rank}: full_state_dict() has keys {sorted(got)}, expected "
                              f"{sorted(exact['final'])} (the wrapped module's parameter names)")
        for name, want64 in exact["final"].items():
            assert_close(got[name], want64.float(), tuple(run["final"][name] for run in at_fp32),
                         what=f"full_state_dict()[{name!r}]",
                         context=f"rank {rank} of {world_size} after {STEPS} steps, {config}",
                         multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps, scale=scale)


@on_ranks(PROBLEM, [2], config=configs)
def test_tied_weights_rejected(ranks, world_size, config):
    config = {**config, "widths": [config["widths"][0], 5, 5, 5], "variant": "tied"}
    for rank, raised in enumerate(ranks.run(construct_on_rank, world_size, config)):
        for _, got in not_raising(raised, "ValueError", with_message=True):
            raise WrongAnswer(f"rank {rank}: FSDP on a module whose block0.second.weight and block2.second.weight are "
                              f"one Parameter must raise ValueError (tied weights are not supported); {got}")


def check_collectives(results: list[dict], config: dict, world_size: int) -> None:
    """Per step: one all-gather of each unit's flat parameter in forward and again in backward, one reduce-scatter
    of each unit's flat gradient in backward, in the compute dtype; nothing else during either."""
    itemsize = DTYPES[config.get("compute_dtype")].itemsize
    padded = sorted(padded_numel(params, world_size) for _, params in units(make_model(config)))
    gathers = sorted(n * itemsize for n in padded)
    scatters = sorted(n // world_size * itemsize for n in padded)
    for rank, result in enumerate(results):
        for step, calls in enumerate(result["calls"], start=1):
            where = f"rank {rank}, step {step} ({config})"
            for phase in ("forward", "backward"):
                issued = [c for c in calls if c[2] == phase]
                got = sorted(c[1] for c in issued if c[0] in ALL_GATHERS)
                if got != gathers:
                    raise WrongAnswer(
                        f"{where}: all-gathers during {phase} moved {got} bytes; expected one per unit, {gathers} "
                        f"bytes (each unit's padded flat parameter in the compute dtype): gather before the unit's "
                        f"{phase} and free after it"
                    )
                other = sorted({c[0] for c in issued if c[0] not in ALL_GATHERS + REDUCE_SCATTERS})
                if other:
                    raise WrongAnswer(f"{where}: {', '.join(other)} issued during {phase}; only all-gathers and "
                                      "(in backward) reduce-scatters belong there")
            got = sorted(c[1] for c in calls if c[0] in REDUCE_SCATTERS and c[2] == "backward")
            if got != scatters:
                late = [c for c in calls if c[0] in REDUCE_SCATTERS and c[2] != "backward"]
                raise WrongAnswer(
                    f"{where}: reduce-scatters during backward wrote {got} bytes ({len(late)} more issued outside "
                    f"backward); expected one per unit, {scatters} bytes (each rank's shard of the unit's flat "
                    "gradient)"
                )


@on_ranks(PROBLEM, [2], config=configs)
def test_collective_pattern(ranks, world_size, config):
    config = {**config, "variant": "frozen"}
    check_collectives(run_training(ranks, world_size, config), config, world_size)


# Widths of 256 and more: on a GPU the caching allocator rounds every tensor up to 512 bytes, which must stay small
# against the one unit of slack allowed below.
@on_ranks(PROBLEM, [2], seed=data_seeds(), width=st.integers(256, 264), optimizer=st.sampled_from(["sgd", "adamw"]))
def test_peak_parameter_memory(ranks, world_size, seed, width, optimizer):
    config = {"seed": seed, "widths": [width] * (MEMORY_UNITS + 1), "rows_per_rank": 1, "optimizer": optimizer,
              "variant": "plain", "measure_memory": True}
    results = run_training(ranks, world_size, config)
    per_unit = units(make_model(config))
    unit_bytes = max(padded_numel(params, world_size) for _, params in per_unit) * 4
    model_bytes = sum(p.numel() for _, params in per_unit for _, p in params) * 4
    # Between steps a rank holds its shards, their gradients and the optimizer's state per element (momentum; or
    # AdamW's two moments), and little else: a unit's worth of slack for scalars and bookkeeping.
    shard_bytes = sum(padded_numel(params, world_size) // world_size for _, params in per_unit) * 4
    persistent = (2 + (2 if optimizer == "adamw" else 1)) * shard_bytes + unit_bytes
    for rank, result in enumerate(results):
        for step, held in enumerate(result["held_between_steps"], start=2):
            if held > persistent:
                raise WrongAnswer(
                    f"rank {rank}: {held} bytes held before step {step}; its shards, their gradients and the "
                    f"optimizer's state take {persistent - unit_bytes} (allowed {persistent}); the whole model's "
                    f"parameters are {model_bytes} bytes: nothing full-size may survive from one step to the next "
                    f"({config})"
                )
        allowed = 4 * unit_bytes + 2 * result["activation_bytes"]
        for step, (peak, where) in enumerate(result["peaks"], start=2):
            if peak > allowed:
                raise WrongAnswer(
                    f"rank {rank}, step {step}: {peak} bytes held above the step's start (highest at {where}); "
                    f"allowed {allowed} = 4 x the largest unit ({unit_bytes}) + 2 x the activations "
                    f"({result['activation_bytes']}); the whole model's parameters are {model_bytes} bytes: free each "
                    f"unit's gathered parameters after its forward and after its backward ({config})"
                )


@on_ranks(PROBLEM, [2], config=configs)
def test_compute_dtype_bf16(ranks, world_size, config):
    config = {**config, "variant": "plain", "compute_dtype": "bfloat16"}
    results = run_training(ranks, world_size, config)
    check_collectives(results, config, world_size)
    # The tolerance is calibrated on the reference's own bf16 run.
    check_training(results, config, world_size, run_training(ranks, world_size, config, reference=True),
                   multiple=PROBLEM.bf16_error_multiple)


@on_ranks(PROBLEM, [4], config=configs)
def test_process_group(ranks, world_size, config):
    """Two independent pairs of ranks, {0, 1} and {2, 3}, each with its own weights, data and FSDP over its own
    group: an FSDP that shards, gathers or reduce-scatters over the default group mixes the pairs' parameters and
    gradients, and one that takes the shard of its global rank finds none in the pair {2, 3}."""
    config = {**config, "variant": "plain", "group_size": 2}
    for index, results in results_by_group(run_training(ranks, world_size, config), 2):
        case = group_case(config, index)
        check_shards_at_construction(results, case, 2, group=index)
        check_training(results, case, 2, group=index)


# --- speed on two GPUs ----------------------------------------------------------------------------------------------

def time_training_steps(student, rank: int, world_size: int, width: int, units_count: int, rows: int,
                        dtype: str, rank_data: dict) -> dict:
    """Runs in a rank process on its GPU: whole training steps of the module's FSDP timed after warm-up, on a batch
    from this rank's own secret seed."""
    device = rank_device()
    config = {"seed": 0, "widths": [width] * (units_count + 1), "variant": "plain"}
    model = make_model(config).to(device)
    fsdp = student.FSDP(model, compute_dtype=getattr(torch, dtype) if dtype != "float32" else None)
    optimizer = make_optimizer("adamw", list(fsdp.sharded_parameters()))
    generator = torch.Generator(device).manual_seed(rank_data["data_seed"])
    x = torch.randn(rows, width, device=device, generator=generator)
    y = torch.randn(rows, width, device=device, generator=generator)

    def step():
        loss = torch.nn.functional.mse_loss(fsdp(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return time_steps(step) | weight_sums(fsdp.full_state_dict().values())


@multi_gpu(2)
@pytest.mark.parametrize("case", PROBLEM.speed.cases(), ids=str)
def test_speed(ranks, partial_credit, case):
    (width, units_count, rows), dtype = case
    # bf16 compute: two correct implementations may round differently, so losses and weights agree to 1e-2.
    grade_step_time(ranks, partial_credit, time_training_steps, 2, (width, units_count, rows, dtype), PROBLEM.speed,
                    f"{units_count} units of width {width}, {rows} rows per rank, {dtype}", rtol=1e-2)
