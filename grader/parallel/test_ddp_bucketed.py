"""Grading parallel.ddp_bucketed: data parallelism with one asynchronous all-reduce per bucket of gradients.

The program `train_on_rank` runs inside each rank process with the student's module; everything it returns is
compared here, in the grader's process, against single-process training on the full batch and against the bucket
partition the contract pins, computed here from the model. Each rank's shard of the batch and its initial weights are
built here and reach that rank alone (`rank_data`); the arguments every rank sees hold only shapes, dtypes, the
bucket limit and the size of its group, so no rank can rebuild another's data or weights without communicating.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_close, largest_magnitude
from grader.checks.marks import multi_gpu
from grader.checks.outcomes import StudentCrashed, StudentError, StudentTimedOut, WrongAnswer
from grader.checks.profiles import on_ranks
from grader.checks.strategies import data_seeds
from grader.parallel.models import TiedMLP, check_module_kept, shard_mean_loss
from grader.ranks import recorder
from grader.ranks.rank import rank_device
from grader.ranks.rank_data import plain_state, row_shards
from grader.ranks.step_time import grade_step_time, time_steps, weight_sums
from grader.ranks.subgroups import (
    group_case,
    inputs_by_group,
    join_group,
    rank_name,
    results_by_group,
    with_setup,
)
from grader.session.context import world_sizes

PROBLEM = BY_ID["parallel.ddp_bucketed"]
STEPS = 3
LEARNING_RATE = 0.1
MOMENTUM = 0.9
BYTES_PER_MB = 2**20
# Rank r of a case starts from the weights of seed + r * RANK_SEED_STRIDE: far from subgroups.SEED_STRIDE, so that no
# rank of one group starts from the weights of a rank of another.
RANK_SEED_STRIDE = 101
GROUP_SIZE = 2  # test_process_group: the world of four splits into the groups {0, 1} and {2, 3}
GROUPS_SETUP = ("4 ranks in two groups, {0, 1} and {2, 3}, each training its own weights and data with a BucketedDDP "
                "over its own group")

# All-reduces issued so far when backward reached the input of the last layer, one entry per backward (rank process).
MARKS: list[int] = []


class MarkBackward(torch.autograd.Function):
    """Identity whose backward notes how many all-reduces had been issued by then. Autograd accumulates the last
    layer's gradients (and runs their hooks) before it propagates further, so any bucket made only of the last
    layer's parameters must have been issued when this backward runs."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        MARKS.append(sum(call.op == "all_reduce" for call in recorder.CALLS))
        return grad


PARAMETER_NAMES = ("first.weight", "first.bias", "middle.weight", "middle.bias", "again.bias", "last.weight",
                   "last.bias")  # the order of model.parameters(); again.weight is middle.weight
LAST_LAYER = {"last.weight", "last.bias"}


def cast_input(layer: torch.nn.Linear, inputs: tuple) -> tuple:
    """Forward pre-hook: a layer of another dtype than its input's computes in its own (a mixed-precision model)."""
    return tuple(x.to(layer.weight.dtype) for x in inputs)


def build_model(config: dict) -> TiedMLP:
    """The model the ranks train: float32, but for the layers named in config["float64_layers"]."""
    model = TiedMLP(config["width"], config["hidden"], config["outputs"], before_last=MarkBackward.apply)
    for name in config["float64_layers"]:
        getattr(model, name).to(torch.float64)
    for layer in (model.first, model.middle, model.again, model.last):
        layer.register_forward_pre_hook(cast_input)
    return model


def make_model(seed: int, config: dict, exact: bool = False) -> TiedMLP:
    """build_model's model from `seed`'s weights; with `exact`, every parameter and buffer in float64."""
    torch.manual_seed(seed)
    model = build_model(config)
    return model.to(torch.float64) if exact else model


def make_batch(config: dict, world_size: int, dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(config["seed"] + 1)
    rows = config["rows_per_rank"] * world_size
    x = torch.randn(rows, config["width"], generator=generator, dtype=torch.float64)
    y = torch.randn(rows, config["outputs"], generator=generator, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def expected_buckets(config: dict) -> list[list[str]]:
    """The pinned partition: trainable parameters in reverse order, a bucket closed when the next would overflow it
    or has another dtype."""
    model = make_model(0, config)
    limit_bytes = config["bucket_size_mb"] * BYTES_PER_MB
    buckets, current, current_bytes, current_dtype = [], [], 0, None
    for name, param in reversed(list(zip(PARAMETER_NAMES, model.parameters()))):
        if not param.requires_grad:
            continue
        size = param.numel() * param.element_size()
        if current and (param.dtype != current_dtype or current_bytes + size > limit_bytes):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
        current_dtype = param.dtype
    return buckets + [current]


def bucket_bytes(config: dict, bucket: list[str]) -> int:
    sizes = dict(zip(PARAMETER_NAMES, (p.numel() * p.element_size() for p in make_model(0, config).parameters())))
    return sum(sizes[name] for name in bucket)


def bucket_dtype(config: dict, bucket: list[str]) -> str:
    dtypes = dict(zip(PARAMETER_NAMES, (p.dtype for p in make_model(0, config).parameters())))
    return str(dtypes[bucket[0]]).removeprefix("torch.")


def shapes(config: dict, group_size: int) -> dict:
    """What every rank is told: the model's structure and dtypes, the bucket limit and the size of its group, nothing
    its data or weights could be rebuilt from."""
    told = {name: config[name] for name in ("width", "hidden", "outputs", "float64_layers", "bucket_size_mb")}
    return {**told, "group_size": group_size}


def rank_inputs(config: dict, world_size: int) -> list[dict]:
    """Built in the grader's process: rank r's own shard of the batch and its own initial weights, as plain tensors.
    Each rank starts from different weights: only the broadcast at construction can make them agree. Every tensor is
    cloned, so none carries a storage that also holds another rank's rows."""
    x, y = make_batch(config, world_size)
    states = [plain_state(make_model(config["seed"] + RANK_SEED_STRIDE * rank, config)) for rank in range(world_size)]
    return row_shards(x, y, config["rows_per_rank"], states)


def run_training(ranks, world_size: int, config: dict, group_size: int | None = None) -> list[dict]:
    """The student's BucketedDDP trained on `world_size` ranks, each given only its own inputs. With `group_size`, the
    ranks form consecutive groups of that size, each training its own case (its own seed: weights and data) over its
    own group."""
    group_size = group_size or world_size
    return ranks.run(train_on_rank, world_size, shapes(config, group_size),
                     rank_data=inputs_by_group(config, world_size, group_size, rank_inputs))


def train_on_rank(student, rank: int, world_size: int, shape: dict, rank_data: dict) -> dict:
    """Runs in a rank process: the student's BucketedDDP on this rank's shard, every step recorded. `rank_data` (this
    rank's alone) holds its shard "x", "y" and its initial weights "state"; `shape` only the model's structure and
    dtypes, the bucket limit and the size of the group BucketedDDP is given (the default group when it is the world)."""
    device = rank_device()
    group_size = shape["group_size"]
    group = join_group(rank, world_size, group_size) if group_size < world_size else None
    model = build_model(shape)
    model.load_state_dict(rank_data["state"])
    model = model.to(device)
    x_shard, y_shard = rank_data["x"].to(device), rank_data["y"].to(device)
    ddp = student.BucketedDDP(model, shape["bucket_size_mb"], group)
    optimizer = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE, momentum=MOMENTUM
    )
    grads, steps_calls = [], []
    MARKS.clear()
    for _ in range(STEPS):
        recorder.reset()
        output = ddp(x_shard)
        # In the targets' dtype a float64 last layer's output would meet float32 targets, which torch 2.11's
        # mse_loss backward refuses; the promotion is what newer versions do anyway.
        loss = torch.nn.functional.mse_loss(output, y_shard.to(output.dtype))
        with recorder.phase("backward"):
            loss.backward()
        with recorder.phase("finish"):
            ddp.finish_gradient_synchronization()
        grads.append([None if p.grad is None else p.grad.detach().cpu().clone() for p in model.parameters()])
        steps_calls.append([(c.op, c.bytes, c.async_op, c.phase, c.waited) for c in recorder.CALLS])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # PyTorch's default: the next backward allocates new .grad tensors
    return {
        "grads": grads,
        "final": [p.detach().cpu().clone() for p in model.parameters()],
        "calls": steps_calls,
        "marks": list(MARKS),
        "module_kept": getattr(ddp, "module", None) is model,
    }


def train_single_process(config: dict, world_size: int, exact: bool, shards: int = 1) -> dict:
    """The same training on one process over the full batch, from rank 0's initial weights, in the ranks' dtypes or,
    with `exact`, all in float64; the loss is the mean of `shards` row shards' losses (see shard_mean_loss)."""
    model = make_model(config["seed"], config, exact)
    x, y = make_batch(config, world_size, torch.float64 if exact else torch.float32)
    optimizer = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE, momentum=MOMENTUM
    )
    grads = []
    for _ in range(STEPS):
        shard_mean_loss(model, x, y, shards).backward()
        grads.append([None if p.grad is None else p.grad.detach().clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return {"grads": grads, "final": [p.detach().clone() for p in model.parameters()]}


@st.composite
def configs(draw, last_layer_buckets: bool = False) -> dict:
    """Sizes and a bucket limit drawn in bytes (so the partition's edges are hit exactly), given in MB.
    With `last_layer_buckets`, the limit is at most the last layer's size, so at least one bucket holds only it."""
    config = {
        "seed": draw(data_seeds()),
        "width": draw(st.integers(3, 17)),
        "hidden": draw(st.integers(3, 17)),
        "outputs": draw(st.integers(1, 4)),
        "rows_per_rank": draw(st.integers(1, 5)),
        "float64_layers": (),
    }
    sizes = [p.numel() * p.element_size() for p in make_model(0, config).parameters() if p.requires_grad]
    last_layer = (config["hidden"] + 1) * config["outputs"] * 4
    most = last_layer if last_layer_buckets else sum(sizes) + 64
    # First (and so in the smallest examples) a fraction of the model: buckets of several parameters, which differ
    # between forward and reverse order; then any limit, and limits equal to one parameter's size.
    limit = draw(st.one_of(st.integers(3, 8).map(lambda parts: max(1, most // parts)), st.integers(1, most),
                           st.sampled_from(sizes).filter(lambda s: s <= most)))
    return {**config, "bucket_size_mb": limit / BYTES_PER_MB}  # exact: a power-of-two divisor


def limit_at_equality() -> dict:
    """A config whose bucket limit is exactly the size of the first two parameters in bucket order: they share one
    bucket, since only going *past* the limit closes it (a rule off at equality splits them)."""
    config = {"seed": 11, "width": 5, "hidden": 4, "outputs": 3, "rows_per_rank": 2, "float64_layers": ()}
    model = make_model(0, config)
    sizes = [p.numel() * p.element_size() for p in reversed(list(model.parameters())) if p.requires_grad]
    return {**config, "bucket_size_mb": (sizes[0] + sizes[1]) / BYTES_PER_MB}  # exact: a power-of-two divisor


def limit_at_equality_after_a_bucket() -> dict:
    """The same model with a limit of the third and fourth parameters' sizes together (16 + 16 bytes): the first two
    fill a bucket each, the next two share one exactly at the limit. A bucket that starts counting anywhere but 0
    bytes after the first one closed splits them."""
    config = {"seed": 11, "width": 5, "hidden": 4, "outputs": 3, "rows_per_rank": 2, "float64_layers": ()}
    model = make_model(0, config)
    sizes = [p.numel() * p.element_size() for p in reversed(list(model.parameters())) if p.requires_grad]
    return {**config, "bucket_size_mb": (sizes[2] + sizes[3]) / BYTES_PER_MB}  # exact: a power-of-two divisor


def float64_first_and_last() -> dict:
    """A config whose first and last layers are float64, the two between float32, and whose bucket limit exceeds the
    whole model: only the dtype rule splits it, into [last] float64, [again.bias, middle] float32 and [first.weight]
    float64. Buckets that ignore dtype make one all-reduce of a cast concatenation; one open bucket per dtype puts
    first.weight with the last layer."""
    config = {"seed": 5, "width": 6, "hidden": 5, "outputs": 3, "rows_per_rank": 2, "float64_layers": ("first", "last")}
    model_bytes = sum(p.numel() * p.element_size() for p in make_model(0, config).parameters())
    return {**config, "bucket_size_mb": 2 * model_bytes / BYTES_PER_MB}  # exact: a power-of-two divisor


def describe(config: dict) -> str:
    return f"{config} (bucket limit {round(config['bucket_size_mb'] * BYTES_PER_MB)} bytes)"


def compare_tensors(actual: list, exact: list, as_trained: list[list], what: str, context: str) -> None:
    """actual[i] against exact[i], with every run in `as_trained` (single-process runs in the ranks' dtypes) as a
    yardstick and the whole model's scale."""
    scale = largest_magnitude(exact)
    for name, a, e, *yardsticks in zip(PARAMETER_NAMES, actual, exact, *as_trained):
        if e is None:
            if a is not None:
                raise WrongAnswer(f"{what}: the frozen parameter {name} has a .grad; it must stay None ({context})")
            continue
        if a is None:
            raise WrongAnswer(f"{what} of {name} is None ({context})")
        assert_close(a, e, tuple(yardsticks), what=f"{what} of {name}", context=context,
                     multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps, scale=scale)


def all_reduces(calls: list[tuple]) -> list[tuple]:
    return [call for call in calls if call[0] == "all_reduce"]


def check_training(results: list[dict], config: dict, data_ranks: int, group_index: int | None = None) -> None:
    """Each rank's gradients and final weights against the single-process training of `config` on `data_ranks` ranks'
    rows: in float64 as the expected values, in the ranks' dtypes (one loss, and the mean of per-rank losses) as the
    yardsticks of rounding. With `group_index`, the ranks are that group of test_process_group's."""
    exact = train_single_process(config, data_ranks, exact=True)
    as_trained = [train_single_process(config, data_ranks, exact=False, shards=shards) for shards in (1, data_ranks)]
    setup = "" if group_index is None else f" of {GROUPS_SETUP}"
    for rank, result in enumerate(results):
        context = f"{rank_name(rank, data_ranks, group_index)}{setup}, {describe(config)}"
        for step in range(STEPS):
            compare_tensors(result["grads"][step], exact["grads"][step], [run["grads"][step] for run in as_trained],
                            f"gradient after step {step + 1}", context)
        compare_tensors(result["final"], exact["final"], [run["final"] for run in as_trained],
                        f"weights after {STEPS} steps", context)


@on_ranks(PROBLEM, world_sizes(PROBLEM), config=configs())
def test_matches_single_process(ranks, world_size, config):
    check_training(run_training(ranks, world_size, config), config, world_size)


@on_ranks(PROBLEM, [2], config=configs())
@example(config=limit_at_equality())
@example(config=limit_at_equality_after_a_bucket())
@example(config=float64_first_and_last())
def test_bucket_partition(ranks, world_size, config):
    results = run_training(ranks, world_size, config)
    buckets = expected_buckets(config)
    expected = sorted(bucket_bytes(config, bucket) for bucket in buckets)
    layout = "; ".join(f"[{', '.join(bucket)}] {bucket_dtype(config, bucket)} {bucket_bytes(config, bucket)} B"
                       for bucket in buckets)
    check_module_kept(results, "BucketedDDP")
    for rank, result in enumerate(results):
        for step, calls in enumerate(result["calls"], start=1):
            others = sorted({call[0] for call in calls if call[0] != "all_reduce"})
            if others:
                raise WrongAnswer(f"rank {rank}, step {step}: collectives other than all_reduce during a step: "
                                  f"{others} ({describe(config)})")
            got = sorted(call[1] for call in all_reduces(calls))
            if got != expected:
                raise WrongAnswer(
                    f"rank {rank}, step {step}: all-reduces of {got} bytes; the pinned buckets are {expected} bytes "
                    f"(in reverse parameter order, frozen left out, the tied weight once, a bucket of one dtype only, "
                    f"closed when the next parameter's dtype differs: {layout}), one all-reduce per bucket "
                    f"({describe(config)})"
                )
    if config["float64_layers"]:
        # The mixed-dtype model trains in no other test: its buckets' values are checked here, against single-process
        # runs of the same mix as yardsticks.
        check_training(results, config, world_size)


@on_ranks(PROBLEM, [2], config=configs(last_layer_buckets=True))
def test_overlaps_backward(ranks, world_size, config):
    results = run_training(ranks, world_size, config)
    buckets = expected_buckets(config)
    ready_early = sum(set(bucket) <= LAST_LAYER for bucket in buckets)
    for rank, result in enumerate(results):
        for step, calls in enumerate(result["calls"], start=1):
            reduces = all_reduces(calls)
            late = [c for c in reduces if c[3] != "backward"]
            blocking = [c for c in reduces if not c[2]]
            waited_early = [c for c in reduces if c[4] == "backward"]
            if late:
                raise WrongAnswer(f"rank {rank}, step {step}: {len(late)} of {len(reduces)} all-reduces were issued "
                                  "after backward returned; issue each bucket's from the hook of its last gradient "
                                  f"({describe(config)})")
            if blocking:
                raise WrongAnswer(f"rank {rank}, step {step}: {len(blocking)} all-reduces were blocking; "
                                  "use async_op=True and wait in finish_gradient_synchronization()")
            if waited_early:
                raise WrongAnswer(f"rank {rank}, step {step}: {len(waited_early)} of {len(reduces)} all-reduces were "
                                  "waited on during backward, so they did not overlap the rest of it; leave each in "
                                  "flight and wait in finish_gradient_synchronization()")
            issued = result["marks"][step - 1]
            if issued < ready_early:
                raise WrongAnswer(
                    f"rank {rank}, step {step}: when backward had finished the last layer, {issued} all-reduces had "
                    f"been issued, but {ready_early} bucket(s) hold only last-layer gradients and were complete: "
                    f"issue a bucket as soon as its last gradient is ready ({describe(config)})"
                )


@on_ranks(PROBLEM, [4], config=configs())
def test_process_group(ranks, world_size, config):
    """Two independent pairs of ranks, {0, 1} and {2, 3}, each with its own weights and data and a BucketedDDP over
    its own group: one that broadcasts or all-reduces over the default group mixes the pairs' weights and gradients,
    and one that names the broadcast's source by its group rank has ranks 2 and 3 name global rank 0, outside their
    group."""
    try:
        results = run_training(ranks, world_size, config, GROUP_SIZE)
    except (StudentError, StudentCrashed, StudentTimedOut) as error:
        # The ranks' own message speaks of 4 ranks; say that each pair trains with its own group.
        raise with_setup(error, GROUPS_SETUP) from None
    for index, group_results in results_by_group(results, GROUP_SIZE):
        check_training(group_results, group_case(config, index), GROUP_SIZE, index)


# --- speed on two GPUs ----------------------------------------------------------------------------------------------

SPEED_BUCKET_MB = 25.0
SPEED_LEARNING_RATE = 1e-3


def time_training_steps(student, rank: int, world_size: int, layers: int, width: int, rows: int,
                        dtype_name: str, rank_data: dict) -> dict:
    """Runs in a rank process on its GPU: whole training steps (forward, backward, gradient synchronisation,
    optimizer step) timed after warm-up, on a batch from this rank's own secret seed."""
    device = rank_device()
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    stack = []
    for _ in range(layers):
        stack += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*stack).to(device, dtype)
    generator = torch.Generator(device=device).manual_seed(rank_data["data_seed"])
    x = torch.randn(rows, width, generator=generator, device=device, dtype=dtype)
    ddp = student.BucketedDDP(model, SPEED_BUCKET_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=SPEED_LEARNING_RATE)

    def step():
        loss = ddp(x).float().square().mean()
        loss.backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss.detach()

    return time_steps(step) | weight_sums(model.parameters())


@multi_gpu(2)
@pytest.mark.parametrize("case", PROBLEM.speed.cases(), ids=str)
def test_speed(ranks, partial_credit, case):
    (layers, width, rows), dtype = case
    grade_step_time(ranks, partial_credit, time_training_steps, 2, (layers, width, rows, dtype), PROBLEM.speed,
                    f"{layers} x Linear({width}, {width}), {rows} rows per rank, {dtype}", rtol=1e-3)
