"""Grading parallel.expert_parallel: an MoE layer whose experts are split over ranks, tokens moved by all_to_all.

Every case is generated here, in the grader's process, from a seed: all tokens, their routing (expert indices and
gates, given, so the test isolates dispatch and combine), all expert weights and an upstream gradient. Each rank
receives only its own part (through rank_data): its tokens, their routing and upstream gradient, and its own experts'
weights; the shared config (without its seed) gives only the sizes. The program `moe_on_rank` runs the student's
layer forward and backward on them, and returns outputs, gradients and the collectives it issued; here they are
compared with one process running the whole layer over all tokens with all experts. In `test_process_group` the four
ranks form two groups of two, each an independent layer over its own group, with its own tokens and experts.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_close
from grader.checks.outcomes import StudentCrashed, StudentError, StudentTimedOut, WrongAnswer
from grader.checks.profiles import on_ranks
from grader.checks.strategies import data_seeds
from grader.ranks import recorder
from grader.ranks.raised import check_value_errors, raised_by
from grader.ranks.rank import rank_device
from grader.ranks.subgroups import group_case, inputs_by_group, join_group, results_by_group, with_setup
from grader.session.context import world_sizes

PROBLEM = BY_ID["parallel.expert_parallel"]
# The token rows a rank may receive in one pass, as a multiple of the minimum, plus room for the counts.
PAYLOAD_SLACK = 1.25
COUNTS_ALLOWANCE_BYTES = 256


def make_case(config: dict, world_size: int, dtype: torch.dtype = torch.float64) -> dict:
    """All ranks' tokens (rank 0's first), their routing, all E experts' weights and the upstream gradient."""
    generator = torch.Generator().manual_seed(config["seed"])
    tokens, width, hidden = sum(config["tokens"]), config["width"], config["hidden"]
    experts = config["experts_per_rank"] * world_size
    allowed = torch.tensor(config["allowed_experts"])
    # k distinct experts per token, drawn from the allowed ones (the others, and maybe whole ranks, get nothing).
    chosen = [allowed[torch.randperm(len(allowed), generator=generator)[: config["k"]]] for _ in range(tokens)]
    expert_index_TK = torch.stack(chosen) if tokens else torch.zeros(0, config["k"], dtype=torch.int64)

    def normal(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype)

    return {
        "x_TD": normal(tokens, width),
        "expert_index_TK": expert_index_TK,
        "gate_TK": (torch.rand(tokens, config["k"], generator=generator, dtype=torch.float64) + 0.1).to(dtype),
        "w_in_EDH": normal(experts, width, hidden, scale=width**-0.5),
        "w_out_EHD": normal(experts, hidden, width, scale=hidden**-0.5),
        "grad_y_TD": normal(tokens, width),
    }


def token_rows(config: dict, rank: int) -> slice:
    start = sum(config["tokens"][:rank])
    return slice(start, start + config["tokens"][rank])


def expert_rows(config: dict, rank: int) -> slice:
    per_rank = config["experts_per_rank"]
    return slice(rank * per_rank, (rank + 1) * per_rank)


def moe_on_rank(student, rank: int, world_size: int, config: dict, *, rank_data: dict) -> dict:
    """Runs in a rank process: the student's layer on this rank's tokens and experts (rank_data: this rank's part of
    make_case), forward and backward. With config["group_size"], the ranks form consecutive groups of that size, each
    an independent layer whose experts are split over its own group."""
    device = rank_device()
    group_size = config.get("group_size") or world_size
    group = join_group(rank, world_size, group_size) if group_size < world_size else None
    x_TD = rank_data["x_TD"].to(device).requires_grad_()
    gate_TK = rank_data["gate_TK"].to(device).requires_grad_()
    w_in_EDH = rank_data["w_in_EDH"].to(device).requires_grad_()
    w_out_EHD = rank_data["w_out_EHD"].to(device).requires_grad_()
    recorder.reset()
    with recorder.phase("forward"):
        y_TD = student.expert_parallel_moe(x_TD, rank_data["expert_index_TK"].to(device), gate_TK, w_in_EDH,
                                           w_out_EHD, config["experts_per_rank"] * group_size, group=group)
    with recorder.phase("backward"):
        y_TD.backward(rank_data["grad_y_TD"].to(device))

    def fetched(t):
        return None if t is None else t.detach().cpu().clone()

    return {
        "y_TD": fetched(y_TD),
        "grads": [fetched(t.grad) for t in (x_TD, gate_TK, w_in_EDH, w_out_EHD)],
        "calls": [(c.op, c.bytes, c.phase) for c in recorder.CALLS if not getattr(c, "nested", False)],
    }


TOKEN_FIELDS = ("x_TD", "expert_index_TK", "gate_TK", "grad_y_TD")
EXPERT_FIELDS = ("w_in_EDH", "w_out_EHD")


def rank_inputs(config: dict, world_size: int) -> list[dict]:
    """Each rank's part of make_case: its own tokens (with their routing and upstream gradient) and its own experts'
    weights."""
    case = make_case(config, world_size, torch.float32)
    # Cloned: a slice saved whole would carry its base tensor's storage, every rank's rows, along with it.
    return [
        {**{name: case[name][token_rows(config, rank)].clone() for name in TOKEN_FIELDS},
         **{name: case[name][expert_rows(config, rank)].clone() for name in EXPERT_FIELDS}}
        for rank in range(world_size)
    ]


def run_on_ranks(ranks, world_size: int, config: dict) -> list[dict]:
    """Each rank's results, each rank given only its own inputs (rank_inputs; with config["group_size"], its part of
    its group's case); all ranks share only the config without its seed."""
    group_size = config.get("group_size") or world_size
    public = {key: value for key, value in config.items() if key != "seed"}
    return ranks.run(moe_on_rank, world_size, public,
                     rank_data=inputs_by_group(config, world_size, group_size, rank_inputs))


def single_rank(config: dict, world_size: int, dtype: torch.dtype, reference) -> dict:
    case = make_case(config, world_size, dtype)
    leaves = [case[name].requires_grad_() for name in ("x_TD", "gate_TK", "w_in_EDH", "w_out_EHD")]
    y_TD = reference.expert_parallel_moe_torch(case["x_TD"], case["expert_index_TK"], case["gate_TK"],
                                               case["w_in_EDH"], case["w_out_EHD"])
    y_TD.backward(case["grad_y_TD"])
    return {"y_TD": y_TD.detach(), "grads": [leaf.grad for leaf in leaves]}


GRADIENT_NAMES = ("x_TD", "gate_TK", "w_in_EDH", "w_out_EHD")


def check_against_single_rank(results: list[dict], config: dict, world_size: int, reference) -> None:
    exact = single_rank(config, world_size, torch.float64, reference)
    at_fp32 = single_rank(config, world_size, torch.float32, reference)
    close = dict(multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps)
    # Every rank's output first: a misrouted row shows up there, before it spoils gradients on other ranks.
    for rank, result in enumerate(results):
        mine = token_rows(config, rank)
        assert_close(result["y_TD"], exact["y_TD"][mine], at_fp32["y_TD"][mine], what="output y_TD",
                     context=f"rank {rank} of {world_size}, {config}", **close)
    for rank, result in enumerate(results):
        rows = [token_rows(config, rank)] * 2 + [expert_rows(config, rank)] * 2
        for name, got, rows_of, want, want32 in zip(GRADIENT_NAMES, result["grads"], rows, exact["grads"],
                                                    at_fp32["grads"]):
            # No gradient at all (a rank without tokens, an expert without rows) counts as a zero gradient.
            got = torch.zeros_like(want32[rows_of]) if got is None else got
            assert_close(got, want[rows_of], want32[rows_of], what=f"gradient of {name}",
                         context=f"rank {rank} of {world_size}, {config}", **close)


@st.composite
def configs(draw, world_size: int, tokens=None, widths=None, k=None, skewed: bool = False) -> dict:
    """A case whose simplest draw (all a budget of one example gets) is already uneven: each strategy lists a
    typical range first, and rank r gets r more tokens than drawn (in `skewed` cases, rank 0 gets 4 more, so the
    others may hold none)."""
    experts_per_rank = draw(st.integers(2, 3) | st.just(1))
    experts = experts_per_rank * world_size
    if k is None:
        k = draw(st.integers(2, min(experts, 3)) | st.just(1)) if experts > 1 else 1
    tokens = st.integers(2, 9) if tokens is None else tokens
    drawn_tokens = draw(st.lists(tokens, min_size=world_size, max_size=world_size))
    if skewed:
        tokens_per_rank = [count + (4 if rank == 0 else 0) for rank, count in enumerate(drawn_tokens)]
        # Only a few experts get tokens, always including the last rank's last one: some experts, maybe whole
        # ranks, receive nothing, and the pairs of ranks exchange very different numbers of rows.
        allowed = set(draw(st.lists(st.integers(0, experts - 2), min_size=k - 1, max_size=max(k, experts // 2),
                                    unique=True)))
        allowed.add(experts - 1)
    else:
        tokens_per_rank = [count + rank for rank, count in enumerate(drawn_tokens)]
        allowed = set(range(experts))
    return {
        "seed": draw(data_seeds()),
        "tokens": tokens_per_rank,
        "width": draw(st.integers(3, 6) | st.integers(1, 2) if widths is None else widths),
        # The simplest hidden size (3) is not the simplest number of local experts (2): a check of w_out_EHD that
        # reads its hidden dimension instead of its expert dimension then refuses valid weights.
        "hidden": draw(st.integers(3, 5) | st.integers(1, 2)),
        "experts_per_rank": experts_per_rank,
        "k": k,
        "allowed_experts": sorted(allowed),
    }


@on_ranks(PROBLEM, world_sizes(PROBLEM), data=st.data())
def test_matches_single_rank(ranks, reference, world_size, data):
    config = data.draw(configs(world_size))
    check_against_single_rank(run_on_ranks(ranks, world_size, config), config, world_size, reference)


@on_ranks(PROBLEM, [2], data=st.data())
def test_uneven_and_empty_experts(ranks, reference, world_size, data):
    # Ranks may hold no tokens; only a few experts receive any.
    config = data.draw(configs(world_size, tokens=st.integers(0, 9), skewed=True))
    check_against_single_rank(run_on_ranks(ranks, world_size, config), config, world_size, reference)


def minimum_rows_received(config: dict, world_size: int, rank: int) -> int:
    """Rows routed to this rank's experts (dispatch) plus this rank's own T * k results (combine)."""
    expert_index_TK = make_case(config, world_size)["expert_index_TK"]
    per_rank = config["experts_per_rank"]
    routed_here = int(((expert_index_TK // per_rank) == rank).sum())
    return routed_here + config["tokens"][rank] * config["k"]


@on_ranks(PROBLEM, [2], data=st.data())
def test_uses_all_to_all(ranks, world_size, data):
    # Wide rows and k = 1: token payload dominates the counts, and gathering all tokens costs more than routing.
    config = data.draw(configs(world_size, tokens=st.integers(8, 16), widths=st.integers(32, 48), k=1))
    results = run_on_ranks(ranks, world_size, config)
    for rank, result in enumerate(results):
        payload = minimum_rows_received(config, world_size, rank) * config["width"] * 4
        allowed = PAYLOAD_SLACK * payload + COUNTS_ALLOWANCE_BYTES + 16 * world_size * config["experts_per_rank"] \
            * world_size
        for phase in ("forward", "backward"):
            calls = [(op, size) for op, size, in_phase in result["calls"] if in_phase == phase]
            ops = sorted({op for op, _ in calls})
            received = sum(size for _, size in calls)
            if received > allowed:
                raise WrongAnswer(
                    f"rank {rank} of {world_size}: the collectives of {phase} moved {received} bytes into this rank "
                    f"({', '.join(ops)}); routing needs {payload} bytes of token rows, at most {allowed:.0f} allowed: "
                    f"send each token only to the ranks of its experts ({config})")
            if "all_to_all_single" not in ops:
                raise WrongAnswer(f"rank {rank} of {world_size} issued no all_to_all_single in {phase} (only "
                                  f"{ops}); dispatch and combine tokens with all_to_all_single ({config})")


def call_invalid(student, rank: int, world_size: int) -> dict:
    """Runs in a rank process: the layer with experts that do not split over the ranks, and with w_in or w_out (one of
    them alone) holding another number of experts than E/N."""
    n, width, hidden = world_size, 4, 3
    x_TD, gate_TK = torch.ones(2, width), torch.ones(2, 1)
    index_TK = torch.zeros(2, 1, dtype=torch.int64)

    def layer(w_in_experts: int, w_out_experts: int, num_experts: int):
        return lambda: student.expert_parallel_moe(x_TD, index_TK, gate_TK, torch.ones(w_in_experts, width, hidden),
                                                   torch.ones(w_out_experts, hidden, width), num_experts)

    return raised_by({
        "expert_parallel_moe(num_experts=2N+1): the experts do not split evenly over the N ranks":
            layer(2, 2, 2 * n + 1),
        "expert_parallel_moe(w_in_EDH of 3 experts, w_out_EHD of 2, num_experts=2N): w_in does not hold E/N experts":
            layer(3, 2, 2 * n),
        "expert_parallel_moe(w_in_EDH of 2 experts, w_out_EHD of 3, num_experts=2N): w_out does not hold E/N experts":
            layer(2, 3, 2 * n),
    })


@pytest.mark.parametrize("world_size", [2])
def test_invalid_arguments(ranks, world_size):
    check_value_errors(ranks.run(call_invalid, world_size))


GROUPS_SETUP = "4 ranks in two groups, {0, 1} and {2, 3}, each calling expert_parallel_moe with its own group"


@on_ranks(PROBLEM, [4], data=st.data())
def test_process_group(ranks, reference, world_size, data):
    """Two independent pairs of ranks, {0, 1} and {2, 3}, each a layer over its own group with its own tokens and
    experts: a layer that routes over the default group sends tokens to the other pair's experts, or to ranks that do
    not hold the experts it counts on."""
    group_size = 2
    config = {**data.draw(configs(group_size)), "group_size": group_size}
    try:
        results = run_on_ranks(ranks, world_size, config)
    except (StudentError, StudentCrashed, StudentTimedOut) as error:
        # The ranks' own message speaks of 4 ranks; say that each pair called the layer with its own group.
        raise with_setup(error, GROUPS_SETUP) from None
    for index, group_results in results_by_group(results, group_size):
        members = list(range(index * group_size, (index + 1) * group_size))
        try:
            check_against_single_rank(group_results, group_case(config, index), group_size, reference)
        except WrongAnswer as error:
            raise WrongAnswer(f"in the group of global ranks {members} (group ranks 0 and 1, the layer called with "
                              f"that group): {error}") from None
