"""Grading parallel.ddp: data parallelism with gradient all-reduces issued from hooks during backward.

The program `train_on_rank` runs inside each rank process with the student's module; everything it returns is
compared here, in the grader's process, against single-process training on the full batch. Each rank's shard of the
batch and its initial weights are built here and reach that rank alone (`rank_data`); the arguments every rank sees
hold only shapes, so no rank can rebuild another's data or weights without communicating.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_close, largest_magnitude
from grader.checks.outcomes import WrongAnswer
from grader.checks.profiles import on_ranks
from grader.checks.strategies import data_seeds
from grader.parallel.models import check_module_kept, shard_mean_loss
from grader.ranks import recorder
from grader.ranks.rank import rank_device
from grader.ranks.rank_data import plain_state, row_shards
from grader.session.context import world_sizes

PROBLEM = BY_ID["parallel.ddp"]
STEPS = 3
LEARNING_RATE = 0.1
MOMENTUM = 0.9


class ProbeNet(torch.nn.Module):
    """A small MLP with a buffer that changes the output (so its broadcast matters), optionally a tied weight
    (the same Parameter in two layers) and frozen parameters."""

    def __init__(self, width: int, variant: str):
        super().__init__()
        self.first = torch.nn.Linear(width, width)
        self.middle = torch.nn.Linear(width, width)
        self.last = torch.nn.Linear(width, 1)
        self.register_buffer("input_scale", torch.rand(width) + 0.5)
        if variant == "tied":
            self.middle.weight = self.first.weight
        if variant == "frozen":
            self.middle.bias.requires_grad_(False)
            self.first.weight.requires_grad_(False)

    def forward(self, x):
        hidden = torch.tanh(self.first(x * self.input_scale))
        return self.last(torch.tanh(self.middle(hidden)))


def make_model(seed: int, width: int, variant: str, dtype: torch.dtype = torch.float32) -> ProbeNet:
    torch.manual_seed(seed)
    return ProbeNet(width, variant).to(dtype)


def make_batch(seed: int, rows: int, width: int, dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(rows, width, generator=generator, dtype=torch.float64)
    y = torch.randn(rows, 1, generator=generator, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def unique_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    return list(model.parameters())  # parameters() yields a tied Parameter once


def shapes(config: dict) -> dict:
    """What every rank is told: the model's structure, nothing its data or weights could be rebuilt from."""
    return {"width": config["width"], "variant": config["variant"]}


def rank_inputs(config: dict, world_size: int) -> list[dict]:
    """Built in the grader's process: rank r's own shard of the batch and its own initial weights, as plain tensors.
    Each rank starts from different weights: only the broadcast at construction can make them agree. Every tensor is
    cloned, so none carries a storage that also holds another rank's rows."""
    x, y = make_batch(config["seed"], config["rows_per_rank"] * world_size, config["width"])
    states = [plain_state(make_model(config["seed"] + 7919 * rank, config["width"], config["variant"]))
              for rank in range(world_size)]
    return row_shards(x, y, config["rows_per_rank"], states)


def run_training(ranks, world_size: int, config: dict) -> list[dict]:
    """The student's DDP trained on `world_size` ranks, each given only its own inputs."""
    return ranks.run(train_on_rank, world_size, shapes(config), rank_data=rank_inputs(config, world_size))


def train_on_rank(student, rank: int, world_size: int, shape: dict, rank_data: dict) -> dict:
    """Runs in a rank process: the student's DDP on this rank's shard, every step recorded. `rank_data` (this rank's
    alone) holds its shard "x", "y" and its initial weights "state"; `shape` only the model's structure."""
    device = rank_device()
    model = ProbeNet(shape["width"], shape["variant"])
    model.load_state_dict(rank_data["state"])
    model = model.to(device)
    x_shard, y_shard = rank_data["x"].to(device), rank_data["y"].to(device)
    ddp = student.DDP(model)
    after_construction = [p.detach().cpu().clone() for p in unique_parameters(model)]
    buffers = [b.detach().cpu().clone() for b in model.buffers()]
    optimizer = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE, momentum=MOMENTUM
    )
    grads, steps_calls = [], []
    for _ in range(STEPS):
        recorder.reset()
        loss = torch.nn.functional.mse_loss(ddp(x_shard), y_shard)
        with recorder.phase("backward"):
            loss.backward()
        with recorder.phase("finish"):
            ddp.finish_gradient_synchronization()
        grads.append([None if p.grad is None else p.grad.detach().cpu().clone() for p in unique_parameters(model)])
        steps_calls.append([(c.op, c.bytes, c.async_op, c.phase, c.waited) for c in recorder.CALLS])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # PyTorch's default: the next backward allocates new .grad tensors
    return {
        "after_construction": after_construction,
        "buffers": buffers,
        "grads": grads,
        "final": [p.detach().cpu().clone() for p in unique_parameters(model)],
        "calls": steps_calls,
        "module_kept": getattr(ddp, "module", None) is model,
    }


def train_single_process(config: dict, world_size: int, dtype: torch.dtype, shards: int = 1) -> dict:
    """The same training on one process over the full batch, from rank 0's initial weights; the loss is the mean of
    `shards` row shards' losses (see shard_mean_loss)."""
    model = make_model(config["seed"], config["width"], config["variant"], dtype)
    x, y = make_batch(config["seed"], config["rows_per_rank"] * world_size, config["width"], dtype)
    optimizer = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE, momentum=MOMENTUM
    )
    initial = [p.detach().clone() for p in unique_parameters(model)]
    grads = []
    for _ in range(STEPS):
        # The mean over the full batch equals the mean over ranks of equal-sized shard means.
        shard_mean_loss(model, x, y, shards).backward()
        grads.append([None if p.grad is None else p.grad.detach().clone() for p in unique_parameters(model)])
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return {"initial": initial, "grads": grads, "final": [p.detach().clone() for p in unique_parameters(model)],
            "buffers": [b.detach().clone() for b in model.buffers()]}


configs = st.fixed_dictionaries(
    {"seed": data_seeds(), "width": st.integers(3, 17), "rows_per_rank": st.integers(1, 5)}
)


def compare_tensors(actual: list, exact: list, at_fp32: list[list], what: str, context: str) -> None:
    """actual[i] against exact[i], with every run in `at_fp32` as a yardstick and the whole model's scale."""
    scale = largest_magnitude(exact)
    for index, (a, e, *yardsticks) in enumerate(zip(actual, exact, *at_fp32)):
        if e is None:
            continue
        if a is None:
            raise WrongAnswer(f"{what} of parameter {index} is None ({context})")
        assert_close(a, e, tuple(yardsticks), what=f"{what} of parameter {index}", context=context,
                     multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps, scale=scale)


def check_training(results: list[dict], config: dict, world_size: int) -> None:
    exact = train_single_process(config, world_size, torch.float64)
    at_fp32 = [train_single_process(config, world_size, torch.float32, shards) for shards in (1, world_size)]
    for rank, result in enumerate(results):
        context = f"rank {rank} of {world_size}, {config}"
        for step in range(STEPS):
            compare_tensors(result["grads"][step], exact["grads"][step], [run["grads"][step] for run in at_fp32],
                            f"gradient after step {step + 1}", context)
        compare_tensors(result["final"], exact["final"], [run["final"] for run in at_fp32],
                        f"weights after {STEPS} steps", context)


@on_ranks(PROBLEM, [2], config=configs)
def test_broadcast_at_construction(ranks, world_size, config):
    config = {**config, "variant": "plain"}
    results = run_training(ranks, world_size, config)
    check_module_kept(results, "DDP")
    expected = make_model(config["seed"], config["width"], "plain")
    for rank, result in enumerate(results):
        for index, (got, want) in enumerate(zip(result["after_construction"], unique_parameters(expected))):
            if not torch.equal(got, want.detach()):
                raise WrongAnswer(f"after DDP(module), parameter {index} on rank {rank} differs from rank 0's "
                                  f"initial value by up to {(got - want).abs().max():.3g}: broadcast from rank 0")
        for index, (got, want) in enumerate(zip(result["buffers"], expected.buffers())):
            if not torch.equal(got, want):
                raise WrongAnswer(f"after DDP(module), buffer {index} on rank {rank} differs from rank 0's")


@on_ranks(PROBLEM, world_sizes(PROBLEM), config=configs)
def test_matches_single_process(ranks, world_size, config):
    config = {**config, "variant": "plain"}
    check_training(run_training(ranks, world_size, config), config, world_size)


def all_reduces_per_step(result: dict) -> list[list[tuple]]:
    return [[call for call in step if call[0] == "all_reduce"] for step in result["calls"]]


@on_ranks(PROBLEM, [2], config=configs)
def test_frozen_parameter(ranks, world_size, config):
    config = {**config, "variant": "frozen"}
    results = run_training(ranks, world_size, config)
    check_training(results, config, world_size)
    frozen = [i for i, p in enumerate(unique_parameters(make_model(0, 3, "frozen"))) if not p.requires_grad]
    trainable = len(unique_parameters(make_model(0, 3, "frozen"))) - len(frozen)
    for rank, result in enumerate(results):
        for index in frozen:
            if result["grads"][-1][index] is not None:
                raise WrongAnswer(f"the frozen parameter {index} has a .grad on rank {rank}; it must stay None")
        counts = {len(step) for step in all_reduces_per_step(result)}
        if counts != {trainable}:
            raise WrongAnswer(f"rank {rank} issued {sorted(counts)} all-reduces per step; expected {trainable}, "
                              "one per parameter that requires grad")


@on_ranks(PROBLEM, [2], config=configs)
def test_tied_weights(ranks, world_size, config):
    config = {**config, "variant": "tied"}
    results = run_training(ranks, world_size, config)
    check_training(results, config, world_size)
    unique = len(unique_parameters(make_model(0, 3, "tied")))
    for rank, result in enumerate(results):
        counts = {len(step) for step in all_reduces_per_step(result)}
        if counts != {unique}:
            raise WrongAnswer(f"rank {rank} issued {sorted(counts)} all-reduces per step for {unique} distinct "
                              "parameters: a tied weight is one parameter, reduced once after both uses")


@on_ranks(PROBLEM, [2], config=configs)
def test_overlaps_backward(ranks, world_size, config):
    config = {**config, "variant": "plain"}
    results = run_training(ranks, world_size, config)
    parameters = len(unique_parameters(make_model(0, 3, "plain")))
    for rank, result in enumerate(results):
        for step, calls in enumerate(all_reduces_per_step(result), start=1):
            late = [c for c in calls if c[3] != "backward"]
            blocking = [c for c in calls if not c[2]]
            waited_early = [c for c in calls if c[4] == "backward"]
            if len(calls) != parameters:
                raise WrongAnswer(f"rank {rank}, step {step}: {len(calls)} all-reduces for {parameters} parameters; "
                                  "expected one per parameter, issued from its gradient hook")
            if late:
                raise WrongAnswer(f"rank {rank}, step {step}: {len(late)} all-reduces were issued after backward "
                                  "returned; issue each from its parameter's hook during backward")
            if blocking:
                raise WrongAnswer(f"rank {rank}, step {step}: {len(blocking)} all-reduces were blocking; "
                                  "use async_op=True and wait in finish_gradient_synchronization()")
            if waited_early:
                raise WrongAnswer(f"rank {rank}, step {step}: {len(waited_early)} all-reduces were waited on during "
                                  "backward, so they did not overlap the rest of it; leave each in flight and wait in "
                                  "finish_gradient_synchronization()")
