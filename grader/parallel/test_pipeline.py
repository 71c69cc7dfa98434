"""Grading parallel.pipeline: a layer sequence split into stages, trained on micro-batches with GPipe and 1F1B.

The whole model and the batch are built here, in the grader's process, from the config's seed; each rank receives
only what its stage holds (through rank_data): its own layers' initial weights, the micro-batch inputs on the first
stage and the targets on the last. The shared config (without its seed) gives only the shapes and the schedule. The
program `train_stage_on_rank` runs inside each rank process: it builds its stage from those weights and records from
hooks on the stage module the order of its forward calls ("F") and of the backward passes through its outputs
("B"). Gradients, losses and weights come back and are compared here with one process training the whole model on
the full batch; the recorded orders are compared with the pinned schedules. In `test_process_group` the four ranks form
two groups of two, each an independent two-stage pipeline over its own group, with its own weights and batch.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_close, assert_raises
from grader.checks.outcomes import StudentCrashed, StudentError, StudentTimedOut, WrongAnswer
from grader.checks.profiles import examples, on_ranks
from grader.checks.strategies import data_seeds
from grader.parallel.bubble import BACKWARD_S, FORWARD_S, ideal_bubble, measured_bubbles, serial_bubble
from grader.ranks.raised import not_raising, raised_by
from grader.ranks.rank import rank_device
from grader.ranks.rank_data import without_seeds
from grader.ranks.subgroups import group_case, inputs_by_group, join_group, results_by_group, with_setup
from grader.session.context import world_sizes

PROBLEM = BY_ID["parallel.pipeline"]
STEPS = 2
LEARNING_RATE = 0.1
MOMENTUM = 0.9
SCHEDULES = ("gpipe", "1f1b")


class Layer(torch.nn.Module):
    """Linear then tanh (no tanh on the model's last layer, so outputs are unbounded like a regression head)."""

    def __init__(self, width_in: int, width_out: int, activation: bool):
        super().__init__()
        self.linear = torch.nn.Linear(width_in, width_out)
        self.activation = activation

    def forward(self, x):
        y = self.linear(x)
        return torch.tanh(y) if self.activation else y


def make_layers(config: dict, dtype: torch.dtype = torch.float32) -> list[Layer]:
    torch.manual_seed(config["seed"])
    widths = config["widths"]
    layers = [Layer(widths[i], widths[i + 1], i + 2 < len(widths)).to(dtype) for i in range(len(widths) - 1)]
    layers[0].linear.bias.requires_grad_(False)  # a frozen parameter: it must get no gradient
    return layers


def make_batch(config: dict, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(config["seed"] + 1)
    rows = config["rows_per_micro_batch"] * config["micro_batches"]
    x = torch.randn(rows, config["widths"][0], generator=generator, dtype=torch.float64)
    y = torch.randn(rows, config["widths"][-1], generator=generator, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def layer_parameters(layers) -> list[torch.Tensor]:
    return [p for layer in layers for p in layer.parameters()]


class RecordBackward(torch.autograd.Function):
    """Identity on the stage's output whose backward notes that a gradient came back through the stage."""

    @staticmethod
    def forward(ctx, output, events):
        ctx.events = events
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        ctx.events.append("B")
        return grad, None


def build_stage(config: dict, first: int, last: int, parameters: list[torch.Tensor]) -> torch.nn.Sequential:
    """Layers first..last-1 of the model, as make_layers builds them, holding the given initial parameters."""
    widths = config["widths"]
    layers = [Layer(widths[i], widths[i + 1], i + 2 < len(widths)) for i in range(first, last)]
    with torch.no_grad():
        for parameter, value in zip(layer_parameters(layers), parameters, strict=True):
            parameter.copy_(value)
    if first == 0:
        layers[0].linear.bias.requires_grad_(False)  # the model's frozen parameter, as in make_layers
    return torch.nn.Sequential(*layers)


def train_stage(student, stage_index: int, stages: int, config: dict, rank_data: dict, group) -> dict:
    """In a rank process: STEPS optimizer steps of stage `stage_index` of a pipeline of `stages` stages over `group`
    (None: the default group), with its event order per step. rank_data holds the stage's initial parameters, and
    the batch's inputs x (first stage) or targets y (last stage)."""
    device = rank_device()
    first, last = config["bounds"][stage_index], config["bounds"][stage_index + 1]
    stage = build_stage(config, first, last, rank_data["parameters"]).to(device)
    events: list[str] = []
    stage.register_forward_pre_hook(lambda module, args: events.append("F"))
    stage.register_forward_hook(lambda module, args, output: RecordBackward.apply(output, events))
    x, y = rank_data["x"], rank_data["y"]
    micro_rows = config["rows_per_micro_batch"]
    input_shape = (micro_rows, config["widths"][first])
    optimizer = torch.optim.SGD([p for p in stage.parameters() if p.requires_grad], lr=LEARNING_RATE,
                                momentum=MOMENTUM)
    grads, losses, orders = [], [], []
    for _ in range(STEPS):
        events.clear()
        loss = student.pipeline_step(
            stage, x.to(device) if stage_index == 0 else None, y.to(device) if stage_index == stages - 1 else None,
            config["micro_batches"], config["schedule"], input_shape, torch.nn.functional.mse_loss, group=group,
        )
        losses.append(None if loss is None else torch.as_tensor(loss).detach().cpu().clone())
        grads.append([None if p.grad is None else p.grad.detach().cpu().clone() for p in stage.parameters()])
        orders.append(list(events))
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return {"grads": grads, "losses": losses, "orders": orders,
            "final": [p.detach().cpu().clone() for p in stage.parameters()]}


def train_stage_on_rank(student, rank: int, world_size: int, config: dict, *, rank_data: dict) -> dict:
    """Runs in a rank process: train_stage of stage `rank` of a pipeline over the whole world."""
    return train_stage(student, rank, world_size, config, rank_data, None)


def train_groups_on_rank(student, rank: int, world_size: int, config: dict, *, rank_data: dict) -> dict:
    """Runs in a rank process: the ranks form consecutive groups of config["group_size"], each a pipeline over its
    own group; this rank is the stage of its place in its group. Each schedule of SCHEDULES trains in turn, from
    the same initial weights: {schedule: train_stage's results}."""
    group_size = config["group_size"]
    group = join_group(rank, world_size, group_size)
    return {schedule: train_stage(student, rank % group_size, group_size, {**config, "schedule": schedule},
                                  rank_data, group)
            for schedule in SCHEDULES}


def train_single_process(config: dict, dtype: torch.dtype, reference) -> dict:
    """The whole model on one process and the full batch, from the same initial weights."""
    layers = make_layers(config, dtype)
    x, y = make_batch(config, dtype)
    optimizer = torch.optim.SGD([p for p in layer_parameters(layers) if p.requires_grad], lr=LEARNING_RATE,
                                momentum=MOMENTUM)
    grads, losses = [], []
    for _ in range(STEPS):
        losses.append(reference.pipeline_step_torch(layers, x, y, torch.nn.functional.mse_loss))
        grads.append([None if p.grad is None else p.grad.detach().clone() for p in layer_parameters(layers)])
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return {"grads": grads, "losses": losses, "final": [p.detach().clone() for p in layer_parameters(layers)]}


def stage_inputs(config: dict, stages: int) -> list[dict]:
    """Each stage's own inputs: its layers' initial weights, the inputs on the first stage and the targets on the
    last."""
    layers = make_layers(config)
    x, y = make_batch(config)
    bounds = config["bounds"]
    return [
        {
            "parameters": [p.detach().clone() for p in layer_parameters(layers[bounds[stage]:bounds[stage + 1]])],
            "x": x if stage == 0 else None,
            "y": y if stage == stages - 1 else None,
        }
        for stage in range(stages)
    ]


def run_stages(ranks, world_size: int, config: dict) -> list[dict]:
    """Each stage's results, each rank given only its own stage_inputs."""
    return ranks.run(train_stage_on_rank, world_size, without_seeds(config), rank_data=stage_inputs(config, world_size))


def expected_order(schedule: str, stages: int, stage: int, micro_batches: int) -> list[str]:
    if schedule == "gpipe":
        return ["F"] * micro_batches + ["B"] * micro_batches
    warmup = min(stages - stage - 1, micro_batches)
    return ["F"] * warmup + ["F", "B"] * (micro_batches - warmup) + ["B"] * warmup


def most_in_flight(order: list[str]) -> int:
    held = most = 0
    for kind in order:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


@st.composite
def configs(draw, world_size: int, schedule: str, micro_batches=None) -> dict:
    """A model of world_size..world_size+3 layers split into world_size contiguous, unevenly sized stages.

    Each strategy lists a typical range first: with a budget of one example, hypothesis draws the simplest value of
    the first alternative, which must still be a case that tells loss scaling and schedules apart (m >= 3).
    """
    layers = draw(st.integers(world_size + 1, world_size + 3) | st.just(world_size))
    cuts = sorted(draw(st.lists(st.integers(1, layers - 1), min_size=world_size - 1, max_size=world_size - 1,
                                unique=True)))
    return {
        "seed": draw(data_seeds()),
        "widths": draw(st.lists(st.integers(2, 7) | st.just(1), min_size=layers + 1, max_size=layers + 1)),
        "bounds": [0, *cuts, layers],
        "micro_batches": draw(st.integers(3, 5) | st.integers(1, 2) if micro_batches is None else micro_batches),
        "rows_per_micro_batch": draw(st.integers(2, 3) | st.just(1)),
        "schedule": schedule,
    }


def compare_tensors(actual: list, exact: list, at_fp32: list, what: str, context: str) -> None:
    for index, (a, e, r) in enumerate(zip(actual, exact, at_fp32, strict=True)):
        if e is None:
            if a is not None:
                raise WrongAnswer(f"{what} of frozen parameter {index} of the stage is not None ({context})")
            continue
        if a is None:
            raise WrongAnswer(f"{what} of parameter {index} of the stage is None ({context})")
        assert_close(a, e, r, what=f"{what} of the stage's parameter {index}", context=context,
                     multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps)


def check_training(results: list[dict], config: dict, world_size: int, reference) -> None:
    exact = train_single_process(config, torch.float64, reference)
    at_fp32 = train_single_process(config, torch.float32, reference)
    layers = make_layers(config)
    for rank, result in enumerate(results):
        context = f"stage {rank} of {world_size}, {config}"
        # This stage's slice of the whole model's parameter list.
        start = len(layer_parameters(layers[: config["bounds"][rank]]))
        stop = len(layer_parameters(layers[: config["bounds"][rank + 1]]))
        for step in range(STEPS):
            compare_tensors(result["grads"][step], exact["grads"][step][start:stop],
                            at_fp32["grads"][step][start:stop], f"gradient after step {step + 1}", context)
        compare_tensors(result["final"], exact["final"][start:stop], at_fp32["final"][start:stop],
                        f"weights after {STEPS} steps", context)
    last = results[-1]["losses"]
    for step in range(STEPS):
        if last[step] is None:
            raise WrongAnswer(f"the last stage returned None as the loss of step {step + 1}; return the full-batch "
                              f"mean loss ({config})")
        assert_close(last[step].reshape(()), exact["losses"][step], at_fp32["losses"][step],
                     what=f"loss returned by the last stage at step {step + 1}", context=f"{config}",
                     multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps)


def check_orders(results: list[dict], config: dict, world_size: int) -> None:
    m, schedule = config["micro_batches"], config["schedule"]
    if schedule == "1f1b":
        # The memory bound first, on every stage: it is what 1F1B is for.
        for rank, result in enumerate(results):
            for step, got in enumerate(result["orders"], start=1):
                if most_in_flight(got) > world_size - rank:
                    raise WrongAnswer(
                        f"stage {rank} of {world_size}, step {step}: order {''.join(got)} holds "
                        f"{most_in_flight(got)} micro-batches in flight; 1F1B allows at most p - s = "
                        f"{world_size - rank} (expected {''.join(expected_order(schedule, world_size, rank, m))}; "
                        f"{config})")
    for rank, result in enumerate(results):
        want = expected_order(schedule, world_size, rank, m)
        for step, got in enumerate(result["orders"], start=1):
            if got != want:
                raise WrongAnswer(f"stage {rank} of {world_size}, step {step}: forward/backward order {''.join(got)}, "
                                  f"expected {''.join(want)} for schedule {schedule!r} with m = {m} ({config})")


@examples(PROBLEM, fraction=10)
@given(stages=st.integers(1, 64), micro_batches=st.integers(1, 512))
def test_bubble_fraction(student, stages, micro_batches):
    got = student.call("bubble_fraction", stages, micro_batches)
    want = ideal_bubble(stages, micro_batches)
    if not isinstance(got, float) or abs(got - want) > 1e-12:
        raise WrongAnswer(f"bubble_fraction({stages}, {micro_batches}) returned {got!r}; expected "
                          f"(p - 1) / (m + p - 1) = {want!r}")
    for bad in ((0, micro_batches), (stages, 0)):
        assert_raises(student.raises("bubble_fraction", *bad), "ValueError", f"bubble_fraction{bad}")


@on_ranks(PROBLEM, world_sizes(PROBLEM), data=st.data())
def test_gpipe_matches_single_process(ranks, reference, world_size, data):
    # The first (and under `ci` the only) draw is one micro-batch, the smallest the contract allows: a pipeline
    # that refuses it, or needs two, fails here; the order tests cover longer schedules.
    config = data.draw(configs(world_size, "gpipe", micro_batches=st.sampled_from([1, 3, 2, 4, 5])))
    check_training(run_stages(ranks, world_size, config), config, world_size, reference)


@on_ranks(PROBLEM, world_sizes(PROBLEM), data=st.data())
def test_one_f_one_b_matches_single_process(ranks, reference, world_size, data):
    config = data.draw(configs(world_size, "1f1b"))
    check_training(run_stages(ranks, world_size, config), config, world_size, reference)


@on_ranks(PROBLEM, [2], data=st.data())
def test_gpipe_order(ranks, world_size, data):
    config = data.draw(configs(world_size, "gpipe", micro_batches=st.integers(2, 6)))
    check_orders(run_stages(ranks, world_size, config), config, world_size)


GROUPS_SETUP = ("4 ranks in two groups, {0, 1} and {2, 3}, each a 2-stage pipeline calling pipeline_step with its "
                "own group (its stage 1 is global rank 1 in the first group, 3 in the second)")


@on_ranks(PROBLEM, [4], data=st.data())
def test_one_f_one_b_order(ranks, world_size, data):
    # m >= p: every stage goes through warm-up, steady state and cool-down.
    config = data.draw(configs(world_size, "1f1b", micro_batches=st.integers(world_size, 2 * world_size + 1)))
    check_orders(run_stages(ranks, world_size, config), config, world_size)


# The overlap case: enough micro-batches that a pipeline's bubble is well below that of stages run one after another.
OVERLAP_MICRO_BATCHES = 8


@pytest.mark.parametrize("world_size", [4])
def test_stages_overlap(ranks, world_size):
    """The point of a pipeline: while one stage works on a micro-batch, the others work on theirs."""
    ideal, serial = ideal_bubble(world_size, OVERLAP_MICRO_BATCHES), serial_bubble(world_size)
    bubbles = measured_bubbles(ranks, world_size, [(schedule, OVERLAP_MICRO_BATCHES) for schedule in SCHEDULES])
    for schedule, bubble in zip(SCHEDULES, bubbles, strict=True):
        setup = (f"schedule {schedule!r}, {world_size} stages, m = {OVERLAP_MICRO_BATCHES}, each stage's forward "
                 f"sleeping {FORWARD_S * 1e3:g} ms and its backward {BACKWARD_S * 1e3:g} ms")
        if bubble < -0.05:
            raise WrongAnswer(f"the step took less time than one stage's own work ({setup}): its stages' sleeps did "
                              "not all run")
        if bubble > (ideal + serial) / 2:
            raise WrongAnswer(f"the stages idled for {bubble:.0%} of the step ({setup}); a pipeline's stages idle for "
                              f"about (p - 1) / (m + p - 1) = {ideal:.0%}, stages that wait for the one before them "
                              f"to finish every micro-batch for 1 - 1/p = {serial:.0%}")


INVALID_STEPS = {"schedule='zigzag'": {"schedule": "zigzag", "micro_batches": 2},
                 "micro_batches=0": {"schedule": "gpipe", "micro_batches": 0}}


def step_invalid(student, rank: int, world_size: int) -> dict:
    """Runs in a rank process: pipeline_step with each invalid argument of INVALID_STEPS, on every stage at once; the
    class names of what each raised (None: it returned). A stage that waits for a peer instead of raising hangs."""
    device = rank_device()
    stage = torch.nn.Linear(4, 4).to(device)
    rows = 4
    inputs = torch.zeros(rows, 4, device=device) if rank == 0 else None
    targets = torch.zeros(rows, 4, device=device) if rank == world_size - 1 else None
    return raised_by({call: functools.partial(student.pipeline_step, stage, inputs, targets,
                                              arguments["micro_batches"], arguments["schedule"], (2, 4),
                                              torch.nn.functional.mse_loss)
                      for call, arguments in INVALID_STEPS.items()})


@pytest.mark.parametrize("world_size", [2])
def test_invalid_arguments(ranks, world_size):
    for rank, raised in enumerate(ranks.run(step_invalid, world_size)):
        for call, got in not_raising(raised, "ValueError"):
            raise WrongAnswer(f"pipeline_step({call}) on stage {rank} of {world_size} must raise ValueError "
                              f"before sending anything; {got}")


@on_ranks(PROBLEM, [4], data=st.data())
def test_process_group(ranks, reference, world_size, data):
    """Two independent 2-stage pipelines, on ranks {0, 1} and {2, 3}, each over its own group with its own weights
    and batch, trained with GPipe and then with 1F1B: a stage that sends to, or receives from, a rank outside its
    group (naming peers by group rank, or using the default group) mixes the pipelines or waits forever."""
    group_size = 2
    config = {**data.draw(configs(group_size, SCHEDULES[0])), "group_size": group_size}
    try:
        results = ranks.run(train_groups_on_rank, world_size, without_seeds(config),
                            rank_data=inputs_by_group(config, world_size, group_size, stage_inputs))
    except (StudentError, StudentCrashed, StudentTimedOut) as error:
        # The ranks' own message speaks of 4 ranks; say that each pair ran its own pipeline over its own group.
        raise with_setup(error, GROUPS_SETUP) from None
    for index, group_results in results_by_group(results, group_size):
        members = list(range(index * group_size, (index + 1) * group_size))
        for schedule in SCHEDULES:
            try:
                check_training([result[schedule] for result in group_results],
                               {**group_case(config, index), "schedule": schedule}, group_size, reference)
            except WrongAnswer as error:
                raise WrongAnswer(f"in the pipeline of global ranks {members} (its stages 0 and 1), schedule "
                                  f"{schedule!r}: {error}") from None
