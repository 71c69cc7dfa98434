"""Grading parallel.tensor_parallel: column/row-parallel linear layers, a tensor-parallel MLP and attention block.

The program `run_layer` runs inside each rank process: it builds the student's sharded layer from the full weights, runs
a few forward/backward/SGD steps and returns outputs, gradients and the collectives of each step. Here, in the grader's
process, the single-rank module (the reference's `*_torch`) runs the same steps on the full weights in float64 (the
expected values) and float32 (the calibration), and each rank's results are compared with the slice of them it should
hold. The tolerance's floor is relative to the largest value of the step (see floor_ulps).

Each rank's inputs are built here and reach that rank alone (`rank_data`): the full weights (every rank holds them:
the constructors shard them), the layer's input (replicated, or only the rank's shard for the row-parallel layer) and
the upstream gradient (only the rank's shard for the column-parallel layer). The arguments every rank sees hold only
shapes, so no rank can rebuild what it should obtain through a collective. The MLP and attention block take replicated
inputs and full weights, so their values could be computed on one rank alone: test_collective_pattern is what shows
that they communicate.

test_process_group runs the same layers, and the regions f and g called directly, in a world of four split into two
groups of two (grader/ranks/subgroups.py), each group with its own weights and data: a collective over the
default group sums four ranks' numbers instead of two.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_close, assert_equal
from grader.checks.outcomes import WrongAnswer
from grader.checks.profiles import on_ranks
from grader.checks.strategies import data_seeds
from grader.ranks import recorder
from grader.ranks.raised import check_value_errors, raised_by
from grader.ranks.rank import rank_device
from grader.ranks.rank_data import integer_tensor, without_seeds
from grader.ranks.subgroups import group_case, inputs_by_group, join_group, rank_name, results_by_group
from grader.session.context import world_sizes

PROBLEM = BY_ID["parallel.tensor_parallel"]
LEARNING_RATE = 0.1
KINDS = ("column", "row", "mlp", "attention")
# Which of the student's parameters each kind has, and how each is cut out of the full one: "rows" (dim 0),
# "columns" (dim 1), "qkv" (rank r's rows of each of the q, k, v blocks) or "full" (replicated).
PARAMETERS = {
    "column": {"weight": "rows", "bias": "rows"},
    "row": {"weight": "columns", "bias": "full"},
    "mlp": {"fc1.weight": "rows", "fc1.bias": "rows", "fc2.weight": "columns", "fc2.bias": "full"},
    "attention": {"qkv.weight": "qkv", "qkv.bias": "qkv", "proj.weight": "columns", "proj.bias": "full"},
}
# Whether the layer's input and output are sharded along their last dimension (else replicated).
SHARDED_INPUT = {"column": False, "row": True, "mlp": False, "attention": False}
SHARDED_OUTPUT = {"column": True, "row": False, "mlp": False, "attention": False}
GROUP_SIZE = 2  # test_process_group's groups: {0, 1} and {2, 3} of a world of four


def floor_ulps(expected64: torch.Tensor, step: dict) -> float:
    """The problem's floor, in ulps of the largest value of the whole step (output and gradients) rather than of this
    tensor: a small gradient is a sum whose terms cancel, and it is exact only to the rounding of those terms, which
    is all a float32 computation in another order can promise."""
    tensors = [step["output"], step["input_grad"], *step["grads"].values()]
    step_scale = max(float(t.abs().max()) for t in tensors if t.numel())
    own_scale = float(expected64.abs().max()) if expected64.numel() else 0.0
    return PROBLEM.floor_ulps * (step_scale / own_scale if own_scale > 0 else 1.0)


def full_linears(case: dict, dtype: torch.dtype = torch.float32) -> dict[str, torch.nn.Linear]:
    """The single-rank module's linear layers, identical wherever they are built from the same case."""
    torch.manual_seed(case["seed"])
    kind = case["kind"]
    if kind == "attention":
        d = attention_width(case)
        shapes = {"qkv": (d, 3 * d), "proj": (d, d)}
    else:
        d, hidden = case["width"], case["per_rank"] * case["world_size"]
        shapes = {"column": {"": (d, hidden)}, "row": {"": (hidden, d)},
                  "mlp": {"fc1": (d, hidden), "fc2": (hidden, d)}}[kind]
    return {name: torch.nn.Linear(i, o, bias=case["bias"]).to(dtype) for name, (i, o) in shapes.items()}


def attention_width(case: dict) -> int:
    return case["heads_per_rank"] * case["world_size"] * case["head_dim"]


def input_width(case: dict) -> int:
    if case["kind"] == "attention":
        return attention_width(case)
    return case["per_rank"] * case["world_size"] if case["kind"] == "row" else case["width"]


def output_width(case: dict) -> int:
    if case["kind"] == "attention":
        return attention_width(case)
    return case["per_rank"] * case["world_size"] if case["kind"] == "column" else case["width"]


def step_tensors(case: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full input x and the upstream gradient of the full output at `step`, in float64."""
    generator = torch.Generator().manual_seed(case["seed"] * 31 + step)
    shape = (case["batch"], case["tokens"])
    x = torch.randn(*shape, input_width(case), generator=generator, dtype=torch.float64)
    upstream = torch.randn(*shape, output_width(case), generator=generator, dtype=torch.float64)
    return x, upstream


def last_dim_shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return t.chunk(world_size, dim=-1)[rank]


def shard_of(full: torch.Tensor, how: str, rank: int, world_size: int) -> torch.Tensor:
    if how == "rows":
        return full.chunk(world_size, dim=0)[rank]
    if how == "columns":
        return full.chunk(world_size, dim=1)[rank]
    if how == "qkv":
        return full.unflatten(0, (3, world_size, -1))[:, rank].flatten(0, 1)
    return full


def rank_inputs(case: dict) -> list[dict]:
    """Built in the grader's process: what rank r holds, as plain CPU tensors. Every rank holds the full weights and
    the replicated tensors; a sharded input or upstream gradient is only the rank's shard, cloned so that no tensor
    carries a storage that also holds another rank's part."""
    world_size = case["world_size"]
    linears = {name: {"weight": linear.weight.detach().clone(),
                      "bias": None if linear.bias is None else linear.bias.detach().clone()}
               for name, linear in full_linears(case).items()}
    inputs = []
    for rank in range(world_size):
        steps = []
        for step in range(case["steps"]):
            x, upstream = step_tensors(case, step)
            if SHARDED_INPUT[case["kind"]]:
                x = last_dim_shard(x, rank, world_size)
            if SHARDED_OUTPUT[case["kind"]]:
                upstream = last_dim_shard(upstream, rank, world_size)
            steps.append({"x": x.clone(), "upstream": upstream.clone()})
        inputs.append({"linears": linears, "steps": steps})
    return inputs


def linear_from(state: dict) -> torch.nn.Linear:
    """A float32 Linear on the CPU holding exactly the given weight and bias."""
    weight, bias = state["weight"], state["bias"]
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


def build_layer(student, case: dict, weights: dict, device: torch.device, group):
    linears = {name: linear_from(state).to(device) for name, state in weights.items()}
    kind = case["kind"]
    if kind == "column":
        return student.ColumnParallelLinear(linears[""], group=group)
    if kind == "row":
        return student.RowParallelLinear(linears[""], group=group)
    if kind == "mlp":
        return student.TensorParallelMLP(linears["fc1"], linears["fc2"], group=group)
    return student.TensorParallelAttention(linears["qkv"], linears["proj"], case["heads"], case["causal"], group=group)


def run_layer(student, rank: int, world_size: int, cases: list[dict], rank_data: list[dict]) -> list[dict]:
    """Runs in a rank process: each case's sharded layer for its steps, with the collectives of every phase. `cases`
    (seen by every rank) hold only shapes; `rank_data` (this rank's alone) holds, per case, the full weights and each
    step's input and upstream gradient as this rank holds them (see rank_inputs)."""
    return layer_steps(student, cases, rank_data, group=None)


def layer_steps(student, cases: list[dict], rank_data: list[dict], group) -> list[dict]:
    """run_layer's work, with every layer sharded over `group` (None: the default group)."""
    device = rank_device()
    results = []
    for case, inputs in zip(cases, rank_data):
        layer = build_layer(student, case, inputs["linears"], device, group)
        parameters = dict(layer.named_parameters())
        optimizer = torch.optim.SGD(list(parameters.values()), lr=LEARNING_RATE)
        steps = []
        for step in range(case["steps"]):
            x, upstream = inputs["steps"][step]["x"], inputs["steps"][step]["upstream"]
            x = x.to(device, torch.float32).requires_grad_(True)
            recorder.reset()
            with recorder.phase("forward"):
                output = layer(x)
            with recorder.phase("backward"):
                output.backward(upstream.to(device, torch.float32))
            steps.append({
                "output": output.detach().cpu(),
                "input_grad": None if x.grad is None else x.grad.cpu(),
                "grads": {name: None if p.grad is None else p.grad.cpu().clone() for name, p in parameters.items()},
                # Calls torch makes from inside a recorded call are part of it: count the outer one only.
                "calls": [(c.op, c.bytes, c.phase) for c in recorder.CALLS if not getattr(c, "nested", False)],
            })
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        results.append({"parameters": sorted(parameters), "steps": steps})
    return results


def single_rank_steps(reference, case: dict, dtype: torch.dtype) -> list[dict]:
    """The single-rank module's outputs and gradients at each step, trained by the same SGD on the full weights."""
    linears = full_linears(case)  # drawn in float32, as on the ranks, then converted
    parameters = {}
    for prefix, linear in linears.items():
        for name, p in linear.named_parameters():
            parameters[f"{prefix}.{name}" if prefix else name] = p.detach().to(dtype).requires_grad_(True)
    p = parameters.get
    kind = case["kind"]
    steps = []
    for step in range(case["steps"]):
        x, upstream = (t.to(dtype) for t in step_tensors(case, step))
        x.requires_grad_(True)
        if kind in ("column", "row"):
            output = reference.linear_torch(x, p("weight"), p("bias"))
        elif kind == "mlp":
            output = reference.mlp_torch(x, p("fc1.weight"), p("fc1.bias"), p("fc2.weight"), p("fc2.bias"))
        else:
            output = reference.attention_torch(x, p("qkv.weight"), p("qkv.bias"), p("proj.weight"), p("proj.bias"),
                                               case["heads"], case["causal"])
        output.backward(upstream)
        steps.append({"output": output.detach(), "input_grad": x.grad,
                      "grads": {name: t.grad.clone() for name, t in parameters.items()}})
        with torch.no_grad():
            for t in parameters.values():
                t -= LEARNING_RATE * t.grad
                t.grad = None
    return steps


def describe(case: dict) -> str:
    kind = case["kind"]
    if kind == "attention":
        shape = (f"H={case['heads']} heads of {case['head_dim']}, D={attention_width(case)}, "
                 f"causal={case['causal']}")
    elif kind == "mlp":
        shape = f"D={case['width']}, F={case['per_rank'] * case['world_size']}"
    else:
        shape = f"I={input_width(case)}, O={output_width(case)}"
    return (f"{kind}, {shape}, bias={case['bias']}, x [{case['batch']}, {case['tokens']}, {input_width(case)}], "
            f"seed={case['seed']}, step {{step}} of {case['steps']}")


def check_values(reference, case: dict, result: dict, rank: int, group_index: int | None = None) -> None:
    world_size, kind = case["world_size"], case["kind"]
    expected_names = sorted(PARAMETERS[kind] if case["bias"] else
                            [n for n in PARAMETERS[kind] if not n.endswith("bias")])
    where = f"{rank_name(rank, world_size, group_index)}, {describe(case)}"
    if result["parameters"] != expected_names:
        raise WrongAnswer(f"the layer's named_parameters() are {result['parameters']}, expected {expected_names} "
                          f"({where.format(step=1)})")
    exact = single_rank_steps(reference, case, torch.float64)
    at_fp32 = single_rank_steps(reference, case, torch.float32)
    for step, (got, e, r) in enumerate(zip(result["steps"], exact, at_fp32), start=1):
        context = where.format(step=step)

        def close(actual, expected64, reference32, what):
            if actual is None:
                raise WrongAnswer(f"{what} is None: no gradient reached it ({context})")
            assert_close(actual, expected64, reference32, what=what, context=context,
                         multiple=PROBLEM.error_multiple, floor_ulps=floor_ulps(expected64, e))

        out_shard = (lambda t: last_dim_shard(t, rank, world_size)) if SHARDED_OUTPUT[kind] else (lambda t: t)
        in_shard = (lambda t: last_dim_shard(t, rank, world_size)) if SHARDED_INPUT[kind] else (lambda t: t)
        close(got["output"], out_shard(e["output"]), out_shard(r["output"]), "output")
        close(got["input_grad"], in_shard(e["input_grad"]), in_shard(r["input_grad"]), "input gradient")
        for name in expected_names:
            how = PARAMETERS[kind][name]
            close(got["grads"][name], shard_of(e["grads"][name], how, rank, world_size),
                  shard_of(r["grads"][name], how, rank, world_size), f"gradient of {name}")


def cases_strategy(kind: str, world_size: int, steps: int) -> st.SearchStrategy[dict]:
    # The simplest draw (the only one under a budget of 1) has a bias, two tokens, a causal mask, several features,
    # two heads on each rank and heads of two dimensions: every part of the contract takes effect in it (with one
    # head a rank, heads and tokens could be mixed up unseen).
    common = {
        "kind": st.just(kind), "world_size": st.just(world_size), "steps": st.just(steps),
        "seed": data_seeds(), "bias": st.sampled_from([True, False]), "batch": st.integers(1, 3),
        "tokens": st.integers(2, 6),
    }
    if kind == "attention":
        return st.fixed_dictionaries({
            **common, "heads_per_rank": st.sampled_from([2, 1, 3]), "head_dim": st.sampled_from([2, 4, 1, 3, 5]),
            "causal": st.sampled_from([True, False]),
        }).map(lambda c: {**c, "heads": c["heads_per_rank"] * world_size})
    return st.fixed_dictionaries({**common, "width": st.integers(2, 9), "per_rank": st.integers(1, 3)})


def run_cases(ranks, world_size: int, cases: list[dict]) -> list[list[dict]]:
    """The student's layers of `cases` on `world_size` ranks, each rank given only its own inputs."""
    per_case = [rank_inputs(case) for case in cases]
    return ranks.run(run_layer, world_size, [without_seeds(case) for case in cases],
                     rank_data=[[inputs[rank] for inputs in per_case] for rank in range(world_size)])


def check_layer(ranks, reference, kind: str, world_size: int, case: dict) -> None:
    results = run_cases(ranks, world_size, [case])
    for rank, result in enumerate(results):
        check_values(reference, case, result[0], rank)


@on_ranks(PROBLEM, [2], data=st.data())
def test_column_parallel_linear(ranks, reference, world_size, data):
    check_layer(ranks, reference, "column", world_size, data.draw(cases_strategy("column", world_size, 1)))


@on_ranks(PROBLEM, [2], data=st.data())
def test_row_parallel_linear(ranks, reference, world_size, data):
    check_layer(ranks, reference, "row", world_size, data.draw(cases_strategy("row", world_size, 1)))


@on_ranks(PROBLEM, world_sizes(PROBLEM), data=st.data())
def test_mlp_matches_single_rank(ranks, reference, world_size, data):
    check_layer(ranks, reference, "mlp", world_size, data.draw(cases_strategy("mlp", world_size, 2)))


@on_ranks(PROBLEM, world_sizes(PROBLEM), data=st.data())
def test_attention_matches_single_rank(ranks, reference, world_size, data):
    check_layer(ranks, reference, "attention", world_size, data.draw(cases_strategy("attention", world_size, 2)))


def expected_calls(case: dict) -> list[tuple[str, int, str]]:
    """(op, bytes, phase) of every collective of one float32 step: g's all-reduce of the full output in forward, f's
    of the full input gradient in backward."""
    rows = case["batch"] * case["tokens"] * 4
    forward = [("all_reduce", rows * output_width(case), "forward")]
    backward = [("all_reduce", rows * input_width(case), "backward")]
    return {"column": backward, "row": forward}.get(case["kind"], forward + backward)


@on_ranks(PROBLEM, [2], data=st.data())
def test_collective_pattern(ranks, world_size, data):
    cases = [data.draw(cases_strategy(kind, world_size, 1)) for kind in KINDS]
    results = run_cases(ranks, world_size, cases)
    for rank, per_case in enumerate(results):
        for case, result in zip(cases, per_case):
            expected = expected_calls(case)
            got = [tuple(call) for call in result["steps"][0]["calls"]]
            if got != expected:
                described = "; ".join(f"{op} of {size} bytes in {phase}" for op, size, phase in got) or "none"
                wanted = "; ".join(f"{op} of {size} bytes in {phase}" for op, size, phase in expected)
                raise WrongAnswer(
                    f"rank {rank} of {world_size} issued the collectives [{described}] for one forward and backward "
                    f"of the {case['kind']} layer; expected exactly [{wanted}] "
                    f"({describe(case).format(step=1)})"
                )


def construct_invalid(student, rank: int, world_size: int) -> dict:
    """Runs in a rank process: each constructor with a size that does not divide by the world size, the attention
    with one wrongly shaped projection (the other one right), and one whose width does not divide by its heads."""
    n = world_size
    attempts = {
        "ColumnParallelLinear(Linear(4, 2N+1)): the size does not divide by N": lambda: student.ColumnParallelLinear(
            torch.nn.Linear(4, 2 * n + 1)),
        "RowParallelLinear(Linear(2N+1, 4)): the size does not divide by N": lambda: student.RowParallelLinear(
            torch.nn.Linear(2 * n + 1, 4)),
        "TensorParallelMLP(Linear(4, 2N+1), Linear(2N+1, 4)): the size does not divide by N": lambda: (
            student.TensorParallelMLP(torch.nn.Linear(4, 2 * n + 1), torch.nn.Linear(2 * n + 1, 4))),
        "TensorParallelAttention(Linear(2N+2, 6N+6), Linear(2N+2, 2N+2), num_heads=N+1): the heads do not divide "
        "by N": lambda: student.TensorParallelAttention(torch.nn.Linear(2 * n + 2, 6 * n + 6),
                                                        torch.nn.Linear(2 * n + 2, 2 * n + 2), n + 1, False),
        "TensorParallelAttention(Linear(2N, 6N), Linear(2N, 2N+1), num_heads=N): proj is not D -> D": lambda: (
            student.TensorParallelAttention(torch.nn.Linear(2 * n, 6 * n), torch.nn.Linear(2 * n, 2 * n + 1), n,
                                            False)),
        "TensorParallelAttention(Linear(4N+2, 12N+6), Linear(4N+2, 4N+2), num_heads=2N): D does not divide by the "
        "heads": lambda: student.TensorParallelAttention(torch.nn.Linear(4 * n + 2, 12 * n + 6),
                                                         torch.nn.Linear(4 * n + 2, 4 * n + 2), 2 * n, False),
    }
    return raised_by(attempts)


@pytest.mark.parametrize("world_size", [2])
def test_invalid_arguments(ranks, world_size):
    check_value_errors(ranks.run(construct_invalid, world_size))


# --- two groups in a world of four --------------------------------------------------------------------------------


def region_inputs(case: dict, group_size: int) -> list[dict[str, torch.Tensor]]:
    """Each rank's input and upstream gradient for f and g, of the case's [batch, tokens, width]."""
    shape = (case["batch"], case["tokens"], case["width"])
    names = ("copy_input", "copy_upstream", "reduce_input", "reduce_upstream")
    return [{name: integer_tensor(case["seed"] * 97 + len(names) * rank + offset, shape)
             for offset, name in enumerate(names)} for rank in range(group_size)]


def run_in_group(student, rank: int, world_size: int, cases: list[dict], rank_data: dict) -> dict:
    """Runs in a rank process of a world split into groups of GROUP_SIZE: f and g called directly, then each case's
    layers (run_layer), every one of them given this rank's group. `rank_data` holds this rank's inputs for the
    regions (region_inputs) and for the layers (rank_inputs), drawn from its group's case."""
    group = join_group(rank, world_size, GROUP_SIZE)
    device = rank_device()
    regions = {}
    for name, function in (("copy", student.copy_to_tensor_parallel_region),
                           ("reduce", student.reduce_from_tensor_parallel_region)):
        x = rank_data["regions"][f"{name}_input"].to(device).requires_grad_(True)
        output = function(x, group=group)
        output.backward(rank_data["regions"][f"{name}_upstream"].to(device))
        regions[name] = {"output": output.detach().cpu(), "input_grad": None if x.grad is None else x.grad.cpu()}
    return {"regions": regions, "layers": layer_steps(student, cases, rank_data["layers"], group)}


def check_regions(case: dict, results: list[dict], group_index: int) -> None:
    """f is the identity forward and sums the group's upstream gradients backward; g sums the group's inputs forward
    and passes the gradient through backward."""
    inputs = region_inputs(case, GROUP_SIZE)
    group_sum = lambda name: sum(own[name] for own in inputs)
    f, g = "copy_to_tensor_parallel_region(x, group)", "reduce_from_tensor_parallel_region(x, group)"
    for rank, result in enumerate(results):
        context = (f"{rank_name(rank, GROUP_SIZE, group_index)}, x [{case['batch']}, {case['tokens']}, "
                   f"{case['width']}] per rank, integer values")
        copy, reduce = result["copy"], result["reduce"]
        for got, expected, what in (
            (copy["output"], inputs[rank]["copy_input"], f"{f} output (x itself)"),
            (copy["input_grad"], group_sum("copy_upstream"),
             f"{f} input gradient (the sum of the upstream gradients of this rank's group)"),
            (reduce["output"], group_sum("reduce_input"), f"{g} output (the sum of x over this rank's group)"),
            (reduce["input_grad"], inputs[rank]["reduce_upstream"], f"{g} input gradient (the upstream gradient)"),
        ):
            if got is None:
                raise WrongAnswer(f"{what}: no gradient reached x ({context})")
            assert_equal(got, expected, what=what, context=context)


@on_ranks(PROBLEM, [4], data=st.data())
def test_process_group(ranks, reference, world_size, data):
    """Two independent groups of two ranks, {0, 1} and {2, 3}, each with its own weights and data, run f, g and every
    layer over their own group: a collective over the default group mixes the two groups' numbers."""
    cases = [data.draw(cases_strategy(kind, GROUP_SIZE, 1)) for kind in KINDS]
    per_case = [inputs_by_group(case, world_size, GROUP_SIZE, lambda own, _: rank_inputs(own)) for case in cases]
    regions = inputs_by_group(cases[0], world_size, GROUP_SIZE, region_inputs)
    results = ranks.run(run_in_group, world_size, [without_seeds(case) for case in cases],
                        rank_data=[{"regions": regions[rank], "layers": [inputs[rank] for inputs in per_case]}
                                   for rank in range(world_size)])
    for index, group_results in results_by_group(results, GROUP_SIZE):
        check_regions(group_case(cases[0], index), [result["regions"] for result in group_results], index)
        for position, case in enumerate(cases):
            for rank, result in enumerate(group_results):
                check_values(reference, group_case(case, index), result["layers"][position], rank, index)
