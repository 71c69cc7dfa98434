"""Grading parallel.sequence_parallel: all-gather / reduce-scatter along the sequence and a sequence-parallel MLP block.

Rank programs run inside each rank process. `run_collectives` checks the two sequence collectives exactly, on
integer-valued tensors whose sums are exact in float32. `run_block` builds the student's block from the full weights,
runs a few forward/backward/SGD steps on the rank's tokens, and returns outputs, gradients and the collectives of each
phase. Here the single-rank block (the reference's `mlp_block_torch`) runs the same steps on the full sequence in
float64 (expected) and float32 (calibration), and each rank is compared with its slice. The tolerance's floor is
relative to the largest value of the step (see floor_ulps).

Each rank's inputs are built here and reach that rank alone (`rank_data`): its own tensors for the collectives; for
the block the full weights (every rank holds them: the constructor shards them), the dropout seeds (drawn apart from
the inputs' seed) and only the rank's own tokens of the input and of the upstream gradient. The arguments every rank
sees hold only shapes, so no rank can rebuild another rank's tokens without communicating.

test_process_group runs the two collectives and the block with dropout in a world of four split into two groups of
two (grader/ranks/subgroups.py), each group with its own weights and data: a collective over the default group
mixes the two groups' tokens or gradients.
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
from grader.ranks.raised import not_raising, raised_by
from grader.ranks.rank import rank_device
from grader.ranks.rank_data import integer_tensor, without_seeds
from grader.ranks.subgroups import group_case, inputs_by_group, join_group, rank_name, results_by_group
from grader.session.context import world_sizes

PROBLEM = BY_ID["parallel.sequence_parallel"]
LEARNING_RATE = 0.1
# How each of the student's parameters is cut out of the single-rank block's: rows, columns, or replicated.
PARAMETERS = {"norm.weight": "full", "norm.bias": "full", "fc1.weight": "rows", "fc1.bias": "rows",
              "fc2.weight": "columns", "fc2.bias": "full"}
# The recorder names each call by the function called; every form of a collective counts as the collective.
SAME_OP = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
           "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter"}
GROUP_SIZE = 2  # test_process_group's groups: {0, 1} and {2, 3} of a world of four


def floor_ulps(expected64: torch.Tensor, step: dict) -> float:
    """The problem's floor, in ulps of the largest value of the whole step (output and gradients) rather than of this
    tensor: a small gradient is a sum whose terms cancel, and it is exact only to the rounding of those terms, which
    is all a float32 computation in another order can promise."""
    tensors = [step["output"], step["input_grad"], *step["grads"].values()]
    step_scale = max(float(t.abs().max()) for t in tensors if t.numel())
    own_scale = float(expected64.abs().max()) if expected64.numel() else 0.0
    return PROBLEM.floor_ulps * (step_scale / own_scale if own_scale > 0 else 1.0)


def sequence_shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return t.chunk(world_size, dim=1)[rank]


def calls_by_phase() -> dict[str, list[tuple[str, int]]]:
    phases: dict[str, list[tuple[str, int]]] = {}
    # A call torch makes from inside another (newer torch's all_gather_into_tensor calls all_gather_single) is the
    # same collective: count the outer one only.
    for call in (c for c in recorder.CALLS if not getattr(c, "nested", False)):
        phases.setdefault(call.phase, []).append((SAME_OP.get(call.op, call.op), call.bytes))
    return phases


# --- the two collectives ------------------------------------------------------------------------------------------


def collective_tensors(case: dict, rank: int) -> dict[str, torch.Tensor]:
    b, t, d, n = case["batch"], case["tokens_per_rank"], case["width"], case["world_size"]
    seed = case["seed"] * 97 + 4 * rank
    return {
        "gather_input": integer_tensor(seed, (b, t, d)),
        "gather_upstream": integer_tensor(seed + 1, (b, n * t, d)),
        "scatter_input": integer_tensor(seed + 2, (b, n * t, d)),
        "scatter_upstream": integer_tensor(seed + 3, (b, t, d)),
    }


def run_collectives(student, rank: int, world_size: int, rank_data: dict) -> dict:
    """Runs in a rank process; `rank_data` (this rank's alone) is its collective_tensors."""
    return collectives_over(student, rank_data, group=None)


def collectives_over(student, rank_data: dict, group) -> dict:
    """run_collectives' work, each collective called with `group` (None: the default group)."""
    device = rank_device()
    tensors = {k: v.to(device) for k, v in rank_data.items()}
    results = {}
    for name, function in (("gather", student.gather_sequence), ("scatter", student.reduce_scatter_sequence)):
        x = tensors[f"{name}_input"].clone().requires_grad_(True)
        recorder.reset()
        with recorder.phase("forward"):
            out = function(x, group=group)
        backward_error = None
        try:
            with recorder.phase("backward"):
                out.backward(tensors[f"{name}_upstream"])
        except RuntimeError as error:  # a wrong shape, say: reported after the output has been checked
            backward_error = f"{type(error).__name__}: {error}"
        results[name] = {"output": out.detach().cpu(), "input_grad": None if x.grad is None else x.grad.cpu(),
                         "input_after": x.detach().cpu(), "calls": calls_by_phase(), "backward_error": backward_error}
    return results


def expected_collectives(case: dict, rank: int) -> dict[str, dict[str, torch.Tensor]]:
    n = case["world_size"]
    per_rank = [collective_tensors(case, r) for r in range(n)]
    return {
        "gather": {
            "output": torch.cat([p["gather_input"] for p in per_rank], dim=1),
            "input_grad": sum(sequence_shard(p["gather_upstream"], rank, n) for p in per_rank),
        },
        "scatter": {
            "output": sum(sequence_shard(p["scatter_input"], rank, n) for p in per_rank),
            "input_grad": torch.cat([p["scatter_upstream"] for p in per_rank], dim=1),
        },
    }


def expected_collective_calls(case: dict) -> dict[str, dict[str, list[tuple[str, int]]]]:
    local = case["batch"] * case["tokens_per_rank"] * case["width"] * 4
    full = local * case["world_size"]
    return {
        "gather": {"forward": [("all_gather", full)], "backward": [("reduce_scatter", local)]},
        "scatter": {"forward": [("reduce_scatter", local)], "backward": [("all_gather", full)]},
    }


def describe_calls(calls: list[tuple[str, int]]) -> str:
    return "[" + "; ".join(f"{op} of {size} bytes" for op, size in calls) + "]" if calls else "none"


def collective_cases(world_size: int) -> st.SearchStrategy[dict]:
    # The simplest draw (the only one under a budget of 1) has several sequences, tokens and features per rank.
    return st.fixed_dictionaries({
        "world_size": st.just(world_size), "seed": data_seeds(), "batch": st.integers(2, 3),
        "tokens_per_rank": st.integers(2, 4), "width": st.integers(3, 6),
    })


def collective_inputs(case: dict, group_size: int) -> list[dict[str, torch.Tensor]]:
    return [collective_tensors(case, rank) for rank in range(group_size)]


def check_collectives(case: dict, results: list[dict], group_index: int | None = None) -> None:
    """Each rank's outputs, input gradients and collectives of gather_sequence and reduce_scatter_sequence."""
    names = {"gather": "gather_sequence", "scatter": "reduce_scatter_sequence"}
    calls = expected_collective_calls(case)
    for rank, result in enumerate(results):
        expected = expected_collectives(case, rank)
        for name, function in names.items():
            context = (f"{rank_name(rank, case['world_size'], group_index)}, x_local_BtD [{case['batch']}, "
                       f"{case['tokens_per_rank']}, {case['width']}] per rank, integer values, seed={case['seed']}")
            got = result[name]
            assert_equal(got["input_after"], collective_tensors(case, rank)[f"{name}_input"],
                         what=f"{function}'s argument after the call (it must not be modified)", context=context)
            assert_equal(got["output"], expected[name]["output"], what=f"{function} output", context=context)
            if got["backward_error"] is not None:
                raise WrongAnswer(f"{function}'s backward raised {got['backward_error']} ({context})")
            if got["input_grad"] is None:
                raise WrongAnswer(f"{function}: no gradient reached its input ({context})")
            assert_equal(got["input_grad"], expected[name]["input_grad"], what=f"{function} input gradient",
                         context=context)
            for phase in ("forward", "backward"):
                issued = got["calls"].get(phase, [])
                if issued != calls[name][phase]:
                    raise WrongAnswer(f"{function} issued {describe_calls(issued)} in {phase}; expected exactly "
                                      f"{describe_calls(calls[name][phase])} ({context})")


@on_ranks(PROBLEM, world_sizes(PROBLEM), data=st.data())
def test_gather_and_reduce_scatter(ranks, world_size, data):
    case = data.draw(collective_cases(world_size))
    check_collectives(case, ranks.run(run_collectives, world_size, rank_data=collective_inputs(case, world_size)))


# --- the block ----------------------------------------------------------------------------------------------------


def full_block(case: dict, dtype: torch.dtype = torch.float32):
    """The single-rank block's modules, identical wherever they are built from the same case."""
    torch.manual_seed(case["seed"])
    d, f = case["width"], case["hidden_per_rank"] * case["world_size"]
    norm = torch.nn.LayerNorm(d, eps=case["eps"])
    with torch.no_grad():  # LayerNorm starts at weight 1, bias 0: draw both so that their gradients matter
        norm.weight.copy_(1 + 0.5 * torch.randn(d))
        norm.bias.copy_(0.5 * torch.randn(d))
    fc1 = torch.nn.Linear(d, f, bias=case["bias"])
    fc2 = torch.nn.Linear(f, d, bias=case["bias"])
    return norm.to(dtype), fc1.to(dtype), fc2.to(dtype)


def step_tensors(case: dict, step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The full input x, the upstream gradient of the full output and the dropout seed at `step` (float64). The
    dropout seed is drawn apart from the inputs' seed: every rank is given it, and it must not reveal the tokens of
    the other ranks."""
    generator = torch.Generator().manual_seed(case["seed"] * 31 + step)
    shape = (case["batch"], case["tokens_per_rank"] * case["world_size"], case["width"])
    x = torch.randn(shape, generator=generator, dtype=torch.float64)
    upstream = torch.randn(shape, generator=generator, dtype=torch.float64)
    return x, upstream, case["dropout_seed"] + 1000 * step


def rank_inputs(case: dict) -> list[dict]:
    """Built in the grader's process: what rank r holds, as plain CPU tensors. Every rank holds the full weights and
    the dropout seeds; of the input and the upstream gradient only its own tokens, cloned so that no tensor carries a
    storage that also holds another rank's tokens."""
    world_size = case["world_size"]
    modules = dict(zip(("norm", "fc1", "fc2"), full_block(case)))
    weights = {name: {"weight": module.weight.detach().clone(),
                      "bias": None if module.bias is None else module.bias.detach().clone()}
               for name, module in modules.items()}
    steps = [step_tensors(case, step) for step in range(case["steps"])]
    return [{"weights": weights,
             "steps": [{"x": sequence_shard(x, rank, world_size).clone(),
                        "upstream": sequence_shard(upstream, rank, world_size).clone(), "seed": seed}
                       for x, upstream, seed in steps]}
            for rank in range(world_size)]


def block_from(case: dict, weights: dict):
    """The float32 norm, fc1 and fc2 on the CPU holding exactly the given weights and biases."""
    norm = torch.nn.LayerNorm(weights["norm"]["weight"].shape[0], eps=case["eps"])
    fc1, fc2 = (torch.nn.Linear(weights[name]["weight"].shape[1], weights[name]["weight"].shape[0],
                                bias=weights[name]["bias"] is not None) for name in ("fc1", "fc2"))
    with torch.no_grad():
        for name, module in (("norm", norm), ("fc1", fc1), ("fc2", fc2)):
            module.weight.copy_(weights[name]["weight"])
            if weights[name]["bias"] is not None:
                module.bias.copy_(weights[name]["bias"])
    return norm, fc1, fc2


def run_block(student, rank: int, world_size: int, case: dict, rank_data: dict) -> dict:
    """Runs in a rank process. `case` (seen by every rank) holds only shapes; `rank_data` (this rank's alone) the full
    weights and, per step, this rank's tokens of the input and of the upstream gradient and the dropout seed."""
    return block_steps(student, case, rank_data, group=None)


def block_steps(student, case: dict, rank_data: dict, group) -> dict:
    """run_block's work, with the block over `group` (None: the default group)."""
    device = rank_device()
    norm, fc1, fc2 = (m.to(device) for m in block_from(case, rank_data["weights"]))
    block = student.SequenceParallelMLPBlock(norm, fc1, fc2, case["dropout_p"], group=group)
    parameters = dict(block.named_parameters())
    optimizer = torch.optim.SGD(list(parameters.values()), lr=LEARNING_RATE)
    steps = []
    for inputs in rank_data["steps"]:
        x, upstream, seed = inputs["x"], inputs["upstream"], inputs["seed"]
        x = x.to(device, torch.float32).requires_grad_(True)
        recorder.reset()
        with recorder.phase("forward"):
            # Seed 0 is left to forward's default (pinned as 0): the simplest draw's first step checks it.
            output = block(x) if seed == 0 else block(x, seed)
        with recorder.phase("backward"):
            output.backward(upstream.to(device, torch.float32))
        with recorder.phase("gradient synchronisation"):
            block.all_reduce_replicated_gradients()
        steps.append({
            "output": output.detach().cpu(),
            "input_grad": None if x.grad is None else x.grad.cpu(),
            "grads": {name: None if p.grad is None else p.grad.cpu().clone() for name, p in parameters.items()},
            "calls": calls_by_phase(),
        })
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"parameters": sorted(parameters), "steps": steps}


def single_rank_steps(reference, case: dict, dtype: torch.dtype) -> list[dict]:
    norm, fc1, fc2 = full_block(case)  # drawn in float32, as on the ranks, then converted
    parameters = {f"{prefix}.{name}": p.detach().to(dtype).requires_grad_(True)
                  for prefix, module in (("norm", norm), ("fc1", fc1), ("fc2", fc2))
                  for name, p in module.named_parameters()}
    p = parameters.get
    steps = []
    for step in range(case["steps"]):
        x, upstream, seed = step_tensors(case, step)
        x = x.to(dtype).requires_grad_(True)
        output = reference.mlp_block_torch(x, p("norm.weight"), p("norm.bias"), case["eps"], p("fc1.weight"),
                                           p("fc1.bias"), p("fc2.weight"), p("fc2.bias"), case["dropout_p"], seed)
        output.backward(upstream.to(dtype))
        steps.append({"output": output.detach(), "input_grad": x.grad,
                      "grads": {name: t.grad.clone() for name, t in parameters.items()}})
        with torch.no_grad():
            for t in parameters.values():
                t -= LEARNING_RATE * t.grad
                t.grad = None
    return steps


def describe(case: dict, step: int) -> str:
    n = case["world_size"]
    return (f"x [{case['batch']}, {case['tokens_per_rank'] * n}, {case['width']}] split into {n} sequence shards, "
            f"F={case['hidden_per_rank'] * n}, bias={case['bias']}, eps={case['eps']}, "
            f"dropout_p={case['dropout_p']}, seed={case['seed']}, "
            + (f"dropout_seed={case['dropout_seed']}, " if case["dropout_p"] > 0 else "")
            + f"step {step} of {case['steps']}")


def shard_of(full: torch.Tensor, how: str, rank: int, world_size: int) -> torch.Tensor:
    if how == "rows":
        return full.chunk(world_size, dim=0)[rank]
    if how == "columns":
        return full.chunk(world_size, dim=1)[rank]
    return full


def check_block(reference, case: dict, results: list[dict], group_index: int | None = None) -> None:
    world_size = case["world_size"]
    expected_names = sorted(n for n in PARAMETERS if case["bias"] or n not in ("fc1.bias", "fc2.bias"))
    exact = single_rank_steps(reference, case, torch.float64)
    at_fp32 = single_rank_steps(reference, case, torch.float32)
    for rank, result in enumerate(results):
        if result["parameters"] != expected_names:
            raise WrongAnswer(f"the block's named_parameters() are {result['parameters']}, expected {expected_names} "
                              f"({rank_name(rank, world_size, group_index)}, {describe(case, 1)})")
        for step, (got, e, r) in enumerate(zip(result["steps"], exact, at_fp32), start=1):
            context = f"{rank_name(rank, world_size, group_index)}, {describe(case, step)}"

            def close(actual, expected64, reference32, what):
                if actual is None:
                    raise WrongAnswer(f"{what} is None: no gradient reached it ({context})")
                assert_close(actual, expected64, reference32, what=what, context=context,
                             multiple=PROBLEM.error_multiple, floor_ulps=floor_ulps(expected64, e))

            tokens = lambda t: sequence_shard(t, rank, world_size)
            close(got["output"], tokens(e["output"]), tokens(r["output"]), "output (this rank's tokens)")
            close(got["input_grad"], tokens(e["input_grad"]), tokens(r["input_grad"]), "input gradient")
            for name in expected_names:
                how = PARAMETERS[name]
                close(got["grads"][name], shard_of(e["grads"][name], how, rank, world_size),
                      shard_of(r["grads"][name], how, rank, world_size),
                      f"gradient of {name} after all_reduce_replicated_gradients()")


def run_blocks(ranks, world_size: int, case: dict) -> list[dict]:
    """The student's block on `world_size` ranks, each given only its own inputs."""
    return ranks.run(run_block, world_size, without_seeds(case), rank_data=rank_inputs(case))


def block_cases(world_size: int, dropout: st.SearchStrategy[float], steps: int) -> st.SearchStrategy[dict]:
    # The simplest draw (the only one under a budget of 1) has biases, several sequences, tokens and features.
    return st.fixed_dictionaries({
        "world_size": st.just(world_size), "steps": st.just(steps), "dropout_p": dropout,
        "seed": data_seeds(), "batch": st.integers(2, 3), "tokens_per_rank": st.integers(2, 4),
        "width": st.integers(3, 8), "hidden_per_rank": st.integers(2, 4), "bias": st.sampled_from([True, False]),
        "eps": st.sampled_from([1e-5, 1e-3]),
        # Drawn apart from `seed` (and last, so that the other fields draw as before): every rank is given the dropout
        # seed, and it must not reveal the inputs' seed. The simplest draw's 0 gives the masks of seed 0.
        "dropout_seed": data_seeds(),
    })


@on_ranks(PROBLEM, world_sizes(PROBLEM), data=st.data())
def test_block_matches_single_rank(ranks, reference, world_size, data):
    case = data.draw(block_cases(world_size, st.just(0.0), steps=2))
    check_block(reference, case, run_blocks(ranks, world_size, case))


@on_ranks(PROBLEM, [2], data=st.data())
def test_dropout_matches_single_rank(ranks, reference, world_size, data):
    case = data.draw(block_cases(world_size, st.sampled_from([0.5, 0.25, 0.1]), steps=2))
    check_block(reference, case, run_blocks(ranks, world_size, case))


@on_ranks(PROBLEM, [2], data=st.data())
def test_collective_pattern(ranks, world_size, data):
    case = data.draw(block_cases(world_size, st.just(0.0), steps=1))
    local = case["batch"] * case["tokens_per_rank"] * case["width"] * 4
    full = local * world_size
    replicated = (2 + case["bias"]) * case["width"] * 4  # norm.weight, norm.bias and fc2.bias, float32
    expected = {
        "forward": [("all_gather", full), ("reduce_scatter", local)],
        "backward": [("all_gather", full), ("reduce_scatter", local)],
    }
    for rank, result in enumerate(run_blocks(ranks, world_size, case)):
        context = f"rank {rank} of {world_size}, {describe(case, 1)}"
        calls = result["steps"][0]["calls"]
        for phase, wanted in expected.items():
            if calls.get(phase, []) != wanted:
                raise WrongAnswer(f"one {phase} of the block issued {describe_calls(calls.get(phase, []))}; expected "
                                  f"exactly {describe_calls(wanted)}: all-gather before fc1, reduce-scatter after "
                                  f"fc2 (and their conjugates in backward), no all-reduce ({context})")
        synchronisation = calls.get("gradient synchronisation", [])
        ops = {op for op, _ in synchronisation}
        total = sum(size for _, size in synchronisation)
        if ops != {"all_reduce"} or total != replicated:
            raise WrongAnswer(f"all_reduce_replicated_gradients() issued {describe_calls(synchronisation)}; expected "
                              f"all-reduces of the {replicated} bytes of the replicated parameters' gradients "
                              f"(norm.weight, norm.bias{', fc2.bias' if case['bias'] else ''}) and nothing else "
                              f"({context})")
        unexpected = sorted(set(calls) - {"forward", "backward", "gradient synchronisation"})
        if unexpected:
            raise WrongAnswer(f"collectives were issued outside forward, backward and synchronisation: "
                              f"{ {p: calls[p] for p in unexpected} } ({context})")


def call_invalid(student, rank: int, world_size: int) -> dict:
    """Runs in a rank process: each invalid call, and what it raised."""
    n = world_size
    attempts = {
        f"reduce_scatter_sequence(x of shape [1, {2 * n + 1}, 3])": lambda: student.reduce_scatter_sequence(
            torch.zeros(1, 2 * n + 1, 3)),
        f"SequenceParallelMLPBlock with fc1 = Linear(3, {2 * n + 1}), fc2 = Linear({2 * n + 1}, 3)": lambda: (
            student.SequenceParallelMLPBlock(torch.nn.LayerNorm(3), torch.nn.Linear(3, 2 * n + 1),
                                             torch.nn.Linear(2 * n + 1, 3), 0.0)),
        "SequenceParallelMLPBlock with dropout_p=1.0": lambda: student.SequenceParallelMLPBlock(
            torch.nn.LayerNorm(3), torch.nn.Linear(3, 2 * n), torch.nn.Linear(2 * n, 3), 1.0),
        "SequenceParallelMLPBlock with dropout_p=-0.1": lambda: student.SequenceParallelMLPBlock(
            torch.nn.LayerNorm(3), torch.nn.Linear(3, 2 * n), torch.nn.Linear(2 * n, 3), -0.1),
    }
    return raised_by(attempts)


@pytest.mark.parametrize("world_size", [2])
def test_invalid_arguments(ranks, world_size):
    for rank, raised in enumerate(ranks.run(call_invalid, world_size)):
        for call, got in not_raising(raised, "ValueError"):
            raise WrongAnswer(f"{call} on rank {rank} of {world_size} must raise ValueError; {got}")


# --- two groups in a world of four --------------------------------------------------------------------------------


def run_in_group(student, rank: int, world_size: int, case: dict, rank_data: dict) -> dict:
    """Runs in a rank process of a world split into groups of GROUP_SIZE: both collectives (run_collectives), then
    the block (run_block), each given this rank's group. `case` is the block's shapes; `rank_data` holds this rank's
    inputs for the collectives and for the block, drawn from its group's cases."""
    group = join_group(rank, world_size, GROUP_SIZE)
    return {"collectives": collectives_over(student, rank_data["collectives"], group),
            "block": block_steps(student, case, rank_data["block"], group)}


@on_ranks(PROBLEM, [4], data=st.data())
def test_process_group(ranks, reference, world_size, data):
    """Two independent groups of two ranks, {0, 1} and {2, 3}, each with its own weights and data, run both
    collectives and the block with dropout over their own group: a collective over the default group mixes the two
    groups' numbers, and a rank index or size taken from the default group cuts the wrong shard."""
    collective_case = data.draw(collective_cases(GROUP_SIZE))
    block_case = data.draw(block_cases(GROUP_SIZE, st.sampled_from([0.5, 0.25, 0.1]), steps=1))
    collectives = inputs_by_group(collective_case, world_size, GROUP_SIZE, collective_inputs)
    blocks = inputs_by_group(block_case, world_size, GROUP_SIZE, lambda own, _: rank_inputs(own))
    results = ranks.run(run_in_group, world_size, without_seeds(block_case),
                        rank_data=[{"collectives": own_collectives, "block": own_block}
                                   for own_collectives, own_block in zip(collectives, blocks)])
    for index, group_results in results_by_group(results, GROUP_SIZE):
        check_collectives(group_case(collective_case, index), [result["collectives"] for result in group_results],
                          index)
        check_block(reference, group_case(block_case, index), [result["block"] for result in group_results], index)
