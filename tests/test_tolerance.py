"""Tolerances of training trajectories: a correct data-parallel run, which rounds differently from one process on the
full batch, passes; the per-value rule it replaced fails some of the same runs (as the reference's DDP did on an
H200 host's CPU: 29 ulps of a last-layer bias gradient after three steps)."""

from __future__ import annotations

import random

import torch

from grader.checks.compare import assert_close
from grader.checks.outcomes import WrongAnswer
from grader.parallel import test_ddp as ddp

CONFIGS = 150


def data_parallel_in_fp32(config: dict, world_size: int) -> dict:
    """What a correct DDP computes in float32: each rank's shard gradient, summed over ranks last to first (another
    order than the grader's yardsticks), divided by the world size."""
    model = ddp.make_model(config["seed"], config["width"], config["variant"])
    x, y = ddp.make_batch(config["seed"], config["rows_per_rank"] * world_size, config["width"])
    optimizer = torch.optim.SGD(model.parameters(), lr=ddp.LEARNING_RATE, momentum=ddp.MOMENTUM)
    grads = []
    for _ in range(ddp.STEPS):
        per_rank = []
        for x_shard, y_shard in zip(x.chunk(world_size), y.chunk(world_size)):
            model.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x_shard), y_shard).backward()
            per_rank.append([p.grad.clone() for p in model.parameters()])
        summed = [sum(reversed(terms)) for terms in zip(*per_rank)]
        for param, total in zip(model.parameters(), summed):
            param.grad = total / world_size
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return {"grads": grads, "final": [p.detach().clone() for p in model.parameters()]}


def drawn_configs() -> list[dict]:
    draw = random.Random(20261202)
    return [{"seed": draw.randrange(2**20), "width": draw.randint(3, 17), "rows_per_rank": draw.randint(1, 5),
             "variant": "plain"} for _ in range(CONFIGS)]


def fails_per_value_rule(result: dict, config: dict, world_size: int) -> bool:
    """The rule before: one full-batch float32 run as the yardstick, each value's own magnitude as the scale."""
    exact = ddp.train_single_process(config, world_size, torch.float64)
    at_fp32 = ddp.train_single_process(config, world_size, torch.float32)
    pairs = [(result["grads"][step], exact["grads"][step], at_fp32["grads"][step]) for step in range(ddp.STEPS)]
    pairs.append((result["final"], exact["final"], at_fp32["final"]))
    try:
        for actual, want64, want32 in pairs:
            for a, e, r in zip(actual, want64, want32):
                assert_close(a, e, r, what="value", context="", multiple=ddp.PROBLEM.error_multiple,
                             floor_ulps=ddp.PROBLEM.floor_ulps)
    except WrongAnswer:
        return True
    return False


def test_correct_data_parallel_rounding_passes_where_the_per_value_rule_failed():
    failed_before = 0
    for config in drawn_configs():
        for world_size in (2, 4):
            result = data_parallel_in_fp32(config, world_size)
            ddp.check_training([result] * world_size, config, world_size)  # raises WrongAnswer on a failure
            failed_before += fails_per_value_rule(result, config, world_size)
    assert failed_before > 0, "no drawn run tells the two rules apart: draw more configs"


def test_a_wrong_average_still_fails():
    """Summing ranks' gradients without dividing by the world size is far outside the widened floor."""
    config = drawn_configs()[0]
    result = data_parallel_in_fp32(config, 2)
    doubled = {"grads": [[2 * g for g in step] for step in result["grads"]], "final": result["final"]}
    try:
        ddp.check_training([doubled, doubled], config, 2)
    except WrongAnswer as failure:
        assert "gradient after step 1" in str(failure)
    else:
        raise AssertionError("doubled gradients passed")


def test_exact_zeros_pass_where_the_truth_is_zero_and_the_reference_rounds():
    """A gradient that is exactly zero in truth (one key per query: the softmax is 1 whatever the score), which a
    float32 reference returns as rounding noise: the exact answer passes, a constant where the truth varies does not."""
    zeros64 = torch.zeros(4, 8, dtype=torch.float64)
    noise = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)) * 1e-7
    assert_close(torch.zeros(4, 8), zeros64, noise, what="dq", context="w=1", multiple=2, floor_ulps=8)
    varying64 = torch.linspace(-1, 1, 32, dtype=torch.float64).reshape(4, 8)
    try:
        assert_close(torch.zeros(4, 8), varying64, varying64.float(), what="dq", context="w=1", multiple=2,
                     floor_ulps=8)
    except WrongAnswer as failure:
        assert "expected output is not constant" in str(failure)
    else:
        raise AssertionError("a constant output passed where the truth varies")
