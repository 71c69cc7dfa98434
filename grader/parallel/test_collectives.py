"""Grading parallel.collectives: broadcast, scatter, gather, reduce, all_gather, reduce_scatter, all_reduce and
all_to_all built from point-to-point messages.

Every rank's inputs are built here, in the grader's process, from each case's seed; each rank receives only its own
(through rank_data: the tensor it contributes, scatter's pieces on the root only, its own all_to_all pieces), while
the shared arguments describe the cases without their seeds. The program `run_cases` runs in each rank: it calls the
student's collective and snapshots the recorded calls. Here every rank's result must equal what the grader computes
from all ranks' inputs, exactly: float32 inputs are multiples of 1/8 below 64 in magnitude, so every order of
summation is exact. Then the recorded calls must be point-to-point only, and the bytes each rank sent and received
through them must lie within the collective's bounds: upper bounds of the algorithms the contract names, and lower
bounds that every correct algorithm of point-to-point messages meets, so that data carried any other way (through the
c10d store, say) fails even with the right values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks import marks
from grader.checks.compare import assert_equal
from grader.checks.outcomes import WrongAnswer
from grader.checks.profiles import examples
from grader.checks.strategies import data_seeds, dims
from grader.ranks import recorder
from grader.ranks.rank import rank_device
from grader.ranks.rank_data import without_seeds
from grader.session.context import world_sizes

PROBLEM = BY_ID["parallel.collectives"]
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
DTYPES = {"float32": torch.float32, "int64": torch.int64}
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
REDUCING = ("reduce", "reduce_scatter", "all_reduce")
ROOTED = ("broadcast", "scatter", "gather", "reduce")


# --- inside each rank -------------------------------------------------------------------------------------------


def call_student(student, case: dict, rank: int, world_size: int, group, device, held) -> dict:
    """The student's collective on this rank's inputs `held` (its rank_data for the case): what it left where the
    contract promises a result."""
    name, root, op = case["collective"], case.get("root", 0), OPS[case.get("op", "sum")]
    dtype = DTYPES[case["dtype"]]
    if name == "scatter":
        pieces = [piece.to(device, copy=True) for piece in held] if rank == root else None
        tensor = torch.zeros(case["shape"], dtype=dtype, device=device)
        student.scatter(tensor, pieces, src=root, group=group)
        return {"result": tensor}
    if name == "all_to_all":
        sizes = case["split_sizes"]
        inputs = [piece.to(device, copy=True) for piece in held]
        outputs = [torch.zeros(sizes[j][rank], case["width"], dtype=dtype, device=device) for j in range(world_size)]
        student.all_to_all(outputs, inputs, group=group)
        return {"result": outputs}
    mine = held.to(device, copy=True)
    if name in ("broadcast", "reduce", "all_reduce"):
        tensor = mine.clone()
        if name == "broadcast":
            student.broadcast(tensor, root, group=group)
        elif name == "reduce":
            student.reduce(tensor, root, op=op, group=group)
        else:
            student.all_reduce(tensor, op=op, group=group)
        return {"result": None if name == "reduce" and rank != root else tensor}
    if name == "gather":
        pieces = [torch.zeros_like(mine) for _ in range(world_size)] if rank == root else None
        student.gather(mine, pieces, dst=root, group=group)
        return {"result": pieces}
    if name == "all_gather":
        pieces = [torch.zeros_like(mine) for _ in range(world_size)]
        student.all_gather(pieces, mine, group=group)
        return {"result": pieces}
    output = torch.zeros_like(mine.flatten().tensor_split(world_size)[rank])
    student.reduce_scatter(output, mine, op=op, group=group)
    return {"result": output, "input_unchanged": torch.equal(mine.cpu(), held)}


def run_cases(student, rank: int, world_size: int, cases: list[dict], subgroups: bool = False, *,
              rank_data: list) -> list[dict]:
    """Runs in a rank process, with `rank_data` this rank's inputs of each case. With `subgroups`, the ranks split
    into the groups [0, 2, ...] and [1, 3, ...] and each case runs inside this rank's group, both groups at once."""
    device = rank_device()
    group = None
    if subgroups:
        halves = [dist.new_group(list(range(start, world_size, 2))) for start in (0, 1)]  # every rank creates both
        group = halves[rank % 2]
    group_rank, group_size = dist.get_rank(group), dist.get_world_size(group)
    results = []
    for case, held in zip(cases, rank_data, strict=True):
        recorder.reset()
        try:
            outcome = call_student(student, case, group_rank, group_size, group, device, held)
        except NotImplementedError:
            raise
        except Exception as error:  # noqa: BLE001 - reported with the case; the peers then fail in their messages
            results.append({"error": f"{type(error).__name__}: {error}"})
            return results  # stop: this rank's messages no longer match its peers'
        outcome["calls"] = [(c.op, c.sent, c.received, c.nested) for c in recorder.CALLS]
        outcome["device"] = device.type
        results.append(outcome)
    return results


def run_invalid_calls(student, rank: int, world_size: int) -> list[tuple[str, list[str] | None]]:
    """Each invalid call on every rank: (description, names of the exception's classes, or None if it returned)."""
    device = rank_device()
    t = torch.ones(3, device=device)
    calls = {
        f"broadcast(tensor, src={world_size})": lambda: student.broadcast(t.clone(), world_size),
        "broadcast(tensor, src=-1)": lambda: student.broadcast(t.clone(), -1),
        f"reduce(tensor, dst={world_size})": lambda: student.reduce(t.clone(), world_size),
        "all_reduce(tensor, op=ReduceOp.PRODUCT)": lambda: student.all_reduce(t.clone(), op=dist.ReduceOp.PRODUCT),
        "reduce_scatter(..., op=ReduceOp.MIN)": lambda: student.reduce_scatter(
            torch.zeros(t.tensor_split(world_size)[rank].numel(), device=device), t.clone(), op=dist.ReduceOp.MIN),
        f"all_gather with a list of {world_size + 1} tensors": lambda: student.all_gather(
            [torch.zeros_like(t) for _ in range(world_size + 1)], t),
        "all_gather with list tensors of another shape": lambda: student.all_gather(
            [torch.zeros(4, device=device) for _ in range(world_size)], t),
        "reduce_scatter with an output one element too long": lambda: student.reduce_scatter(
            torch.zeros(t.tensor_split(world_size)[rank].numel() + 1, device=device), t.clone()),
        f"all_to_all with lists of {world_size - 1} tensors": lambda: student.all_to_all(
            [torch.zeros(1, device=device) for _ in range(world_size - 1)],
            [torch.ones(1, device=device) for _ in range(world_size - 1)]),
    }
    outcomes = []
    for description, call in calls.items():
        try:
            call()
            outcomes.append((description, None))
        except NotImplementedError:
            raise
        except Exception as error:  # noqa: BLE001 - the test judges the class
            outcomes.append((description, [c.__name__ for c in type(error).__mro__]))
    return outcomes


# --- in the grader's process --------------------------------------------------------------------------------------


def make_values(case: dict, rank: int, piece: int = 0, shape: tuple | None = None) -> torch.Tensor:
    """Rank `rank`'s input (its piece for rank `piece`, for scatter's root and all_to_all), from the case's seed."""
    generator = torch.Generator().manual_seed(case["seed"] * 4099 + rank * 64 + piece)
    shape = tuple(case["shape"] if shape is None else shape)
    if case["dtype"] == "int64":
        return torch.randint(-2**40, 2**40, shape, generator=generator)
    return (torch.randint(-511, 512, shape, generator=generator) / 8).float()


def rank_inputs(case: dict, rank: int, world_size: int):
    """What (group) rank `rank` holds before the collective: the tensor it contributes; for scatter, the pieces on
    the root and nothing elsewhere; for all_to_all, its piece for each rank."""
    name = case["collective"]
    if name == "scatter":
        return [make_values(case, rank, i) for i in range(world_size)] if rank == case["root"] else None
    if name == "all_to_all":
        sizes = case["split_sizes"]
        return [make_values(case, rank, j, (sizes[rank][j], case["width"])) for j in range(world_size)]
    return make_values(case, rank)


def launch(ranks, world_size: int, cases: list[dict], group_size: int, subgroups: bool = False) -> list[list[dict]]:
    """Runs the cases on world_size ranks; global rank r is group rank r // (world_size // group_size) of its group
    ([0, 2, ...] and [1, 3, ...] with subgroups) and receives that group rank's inputs only."""
    groups = world_size // group_size
    rank_data = [[rank_inputs(case, rank // groups, group_size) for case in cases] for rank in range(world_size)]
    return ranks.run(run_cases, world_size, [without_seeds(case) for case in cases], subgroups, rank_data=rank_data)


def expected_results(case: dict, world_size: int) -> list:
    """Each rank's correct result from all ranks' inputs (None where the contract promises none): exact, since every
    order of summation is."""
    name, root, n = case["collective"], case.get("root", 0), world_size
    held = [rank_inputs(case, rank, n) for rank in range(n)]
    if name == "broadcast":
        return [held[root]] * n
    if name == "scatter":
        return [held[root][rank] for rank in range(n)]
    if name == "gather":
        return [list(held) if rank == root else None for rank in range(n)]
    if name == "all_gather":
        return [list(held)] * n
    if name == "all_to_all":
        return [[held[j][rank] for j in range(n)] for rank in range(n)]
    stacked = torch.stack(held)
    total = stacked.sum(0) if case.get("op", "sum") == "sum" else stacked.amax(0)
    if name == "reduce":
        return [total if rank == root else None for rank in range(n)]
    if name == "all_reduce":
        return [total] * n
    return [total.flatten().tensor_split(n)[rank] for rank in range(n)]


def on_device(value, device_type: str):
    """The expected value on the device the rank computed on (its results come back there)."""
    if device_type != "cuda":
        return value
    if isinstance(value, list):
        return [v.to(device_type) for v in value]
    return None if value is None else value.to(device_type)


def describe(case: dict, world_size: int) -> str:
    name = case["collective"]
    if name == "all_to_all":
        what = f"pieces of shape (rows, {case['width']}) with rows[i][j] sent from rank i to rank j = " \
               f"{case['split_sizes']}"
    else:
        numel = math.prod(case["shape"])
        per = " per piece" if name in ("scatter", "gather", "all_gather") else ""
        what = f"tensor of shape {tuple(case['shape'])} ({numel} elements{per})"
    extras = [f"{'src' if name in ('broadcast', 'scatter') else 'dst'}={case['root']}"] if name in ROOTED else []
    extras += [f"op={case['op']}"] if name in REDUCING else []
    return (f"{name} of {case['dtype']} {what} on {world_size} ranks"
            + "".join(f", {e}" for e in extras) + f", seed={case['seed']}")


@dataclass(frozen=True)
class ByteBounds:
    """What a collective's ranks may and must move through point-to-point calls, in bytes, each with its rule.

    Upper bounds are those of the algorithms the contract names: per rank, or over all ranks for the trees, whose
    ranks send different amounts. Lower bounds hold for every correct algorithm whatever its shape (direct, ring or
    tree) and for any values of the inputs: a rank cannot learn bytes that only other ranks hold without receiving at
    least as many, nor pass its own on without sending them.
    """

    most_sent: list[int] | None
    most_sent_in_all: int | None
    upper_rule: str
    least_sent: list[int]
    least_received: list[int]
    lower_rule: str


def element_bytes(case: dict) -> int:
    return torch.empty((), dtype=DTYPES[case["dtype"]]).element_size()


def chunk_bytes(case: dict, world_size: int) -> list[int]:
    """Bytes of each chunk of the flattened tensor cut by tensor_split: the first numel % N hold one element more."""
    numel = math.prod(case["shape"])
    return [(numel // world_size + (i < numel % world_size)) * element_bytes(case) for i in range(world_size)]


def all_to_all_bytes(case: dict, world_size: int) -> tuple[list[int], list[int]]:
    """(bytes of each rank's pieces for the other ranks, bytes of the other ranks' pieces for each rank)."""
    sizes, row_bytes = case["split_sizes"], case["width"] * element_bytes(case)
    others = [[j for j in range(world_size) if j != r] for r in range(world_size)]
    return ([sum(sizes[r][j] for j in others[r]) * row_bytes for r in range(world_size)],
            [sum(sizes[j][r] for j in others[r]) * row_bytes for r in range(world_size)])


def upper_bounds(case: dict, world_size: int) -> tuple[list[int] | None, int | None, str]:
    """(per-rank limits, limit on the sum over ranks, the rule in words) for the bytes a collective may send."""
    name, n = case["collective"], world_size
    element = element_bytes(case)
    numel = math.prod(case.get("shape", (0,)))
    tensor_bytes = numel * element
    if name == "broadcast":
        return None, (n - 1) * tensor_bytes, "every rank but src receives the tensor once: (N - 1) * B in all"
    if name == "reduce":
        return None, (n - 1) * tensor_bytes, "every rank but dst sends one tensor: (N - 1) * B in all"
    if name == "scatter":
        limits = [(n - 1) * tensor_bytes if r == case["root"] else 0 for r in range(n)]
        return limits, None, "src sends each other rank its piece once, and nobody else sends anything"
    if name == "gather":
        limits = [0 if r == case["root"] else tensor_bytes for r in range(n)]
        return limits, None, "each rank but dst sends its tensor once, and dst sends nothing"
    if name == "all_gather":
        return [(n - 1) * tensor_bytes] * n, None, "each rank sends at most (N - 1) pieces"
    if name == "reduce_scatter":
        limit = (n - 1) * math.ceil(numel / n) * element
        return [limit] * n, None, "each rank sends at most (N - 1) * ceil(n / N) elements"
    if name == "all_reduce":
        limit = 2 * (n - 1) * math.ceil(numel / n) * element
        return [limit] * n, None, "a ring all-reduce sends at most 2 (N - 1) * ceil(n / N) elements per rank"
    return all_to_all_bytes(case, n)[0], None, "each rank sends each of its pieces for the other ranks once"


def lower_bounds(case: dict, world_size: int) -> tuple[list[int], list[int], str]:
    """(least bytes each rank sends, least bytes each rank receives, the rule in words) of any correct algorithm."""
    name, n = case["collective"], world_size
    ranks = range(n)
    if n < 2:
        return [0] * n, [0] * n, "a single rank has nothing to exchange"
    if name == "all_to_all":
        pieces_out, pieces_in = all_to_all_bytes(case, n)
        return pieces_out, pieces_in, ("each rank must send each of its pieces for the other ranks and receive each "
                                       "of their pieces for it")
    if name == "reduce_scatter":
        chunks = chunk_bytes(case, n)
        return ([sum(chunks) - chunks[r] for r in ranks], chunks,
                "each rank's input counts in every other rank's chunk, so it must send at least the bytes of every "
                "chunk but its own, and receive at least those of its own chunk (the others' share of its result)")
    b = math.prod(case["shape"]) * element_bytes(case)
    if name == "all_reduce":
        return [b] * n, [b] * n, ("every rank's result depends on every other rank's tensor: each rank must send at "
                                  "least B (its tensor, or partial results that include it) and receive at least B")
    if name == "all_gather":
        return [b] * n, [(n - 1) * b] * n, ("each rank must send its piece (b bytes) at least once and receive the "
                                            "N - 1 pieces it does not hold")
    root = case["root"]
    if name == "broadcast":
        return ([b if r == root else 0 for r in ranks], [0 if r == root else b for r in ranks],
                "every rank but src must receive the tensor (B bytes), and src, the only rank that holds it, must "
                "send at least B")
    if name == "scatter":
        return ([(n - 1) * b if r == root else 0 for r in ranks], [0 if r == root else b for r in ranks],
                "each rank but src must receive its piece (b bytes), and src, the only rank that holds the pieces, "
                "must send the N - 1 of the other ranks")
    if name == "gather":
        return ([0 if r == root else b for r in ranks], [(n - 1) * b if r == root else 0 for r in ranks],
                "each rank but dst must send its tensor (b bytes), the only copy, and dst must receive the N - 1 it "
                "does not hold")
    return ([0 if r == root else b for r in ranks], [b if r == root else 0 for r in ranks],
            "each rank but dst must send at least B (its tensor, or a partial result that includes it, all that a "
            "tree's inner ranks send), and dst must receive at least B")


def byte_bounds(case: dict, world_size: int) -> ByteBounds:
    return ByteBounds(*upper_bounds(case, world_size), *lower_bounds(case, world_size))


def check_only_point_to_point(name: str, rank: int, calls: list, context: str) -> None:
    for op, _, _, nested in calls:
        if not nested and op not in POINT_TO_POINT:
            called = op if op.startswith("torch.") else f"torch.distributed.{op}"
            raise WrongAnswer(f"{name} on rank {rank} called {called}: build every collective from "
                              f"send, recv, isend, irecv and batch_isend_irecv only ({context})")


def check_values(name: str, rank: int, got, want, context: str) -> None:
    where = f"{name}'s result on rank {rank}"
    if want is None:
        return
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            raise WrongAnswer(f"{where}: expected a list of {len(want)} tensors ({context})")
        for index, (g, w) in enumerate(zip(got, want)):
            assert_equal(g, w, what=f"{where}, tensor {index} of the list", context=context)
    else:
        assert_equal(got, want, what=where, context=context)


def check_bytes(case: dict, world_size: int, sent: list[int], received: list[int], context: str) -> None:
    """Each rank's bytes sent and received through point-to-point calls within the collective's bounds: the upper
    ones first (too many bytes is the commoner mistake), then the lower ones."""
    bounds = byte_bounds(case, world_size)
    name = case["collective"]
    counts = f"bytes sent by rank: {sent}, received: {received}; {context}"
    for rank, (limit, actual) in enumerate(zip(bounds.most_sent or [], sent)):
        if actual > limit:
            raise WrongAnswer(f"{name}: rank {rank} sent {actual} bytes, more than the {limit} allowed: "
                              f"{bounds.upper_rule} ({counts})")
    if bounds.most_sent_in_all is not None and sum(sent) > bounds.most_sent_in_all:
        raise WrongAnswer(f"{name}: the ranks sent {sum(sent)} bytes in all, more than the {bounds.most_sent_in_all} "
                          f"allowed: {bounds.upper_rule} ({counts})")
    for direction, actual_bytes, least in (("received", received, bounds.least_received),
                                           ("sent", sent, bounds.least_sent)):
        for rank, (actual, bound) in enumerate(zip(actual_bytes, least)):
            if actual < bound:
                raise WrongAnswer(f"{name}: rank {rank} {direction} {actual} bytes through point-to-point calls, "
                                  f"below the lower bound of {bound}: {bounds.lower_rule}; data that travels any "
                                  f"other way does not count ({counts})")


def check_cases(cases: list[dict], results: list[list[dict]], world_size: int) -> None:
    """Every rank's result of every case: point-to-point only, equal to the grader's, then within the byte bounds
    (lower as well as upper, sent and received)."""
    for index, case in enumerate(cases):
        context = describe(case, world_size)
        expected = expected_results(case, world_size)
        name = case["collective"]
        outcomes = [per_rank[index] if index < len(per_rank) else {"error": "stopped after an earlier error"}
                    for per_rank in results]
        errors = [f"rank {rank}: {o['error'][:300]}" for rank, o in enumerate(outcomes) if "error" in o]
        if errors:
            raise WrongAnswer(f"{name} raised an exception ({context}):\n" + "\n".join(errors))
        for rank, outcome in enumerate(outcomes):
            check_only_point_to_point(name, rank, outcome["calls"], context)
        for rank, outcome in enumerate(outcomes):
            check_values(name, rank, outcome["result"], on_device(expected[rank], outcome.get("device")), context)
            if outcome.get("input_unchanged") is False:
                raise WrongAnswer(f"{name} changed its input on rank {rank}; leave it unchanged ({context})")
        sent = [sum(s for _, s, _, nested in o["calls"] if not nested) for o in outcomes]
        received = [sum(r for _, _, r, nested in o["calls"] if not nested) for o in outcomes]
        check_bytes(case, world_size, sent, received, context)


# --- strategies and tests ---------------------------------------------------------------------------------------

shapes = st.one_of(st.tuples(dims(40)), st.tuples(dims(6), dims(9)))


@st.composite
def case_lists(draw, collective: str, world_size: int) -> list[dict]:
    """Cases of one launch: 1 element, fewer elements than ranks, and two drawn shapes, each in both dtypes."""
    seed = draw(data_seeds())
    # Roots take turns over the cases from a drawn first one: every launch has every rank as a root, so a tree
    # that is right only from rank 0 fails even in the simplest draw.
    first_root = draw(st.integers(0, world_size - 1))
    drawn = [(1,), (max(world_size - 1, 1),), draw(shapes), draw(shapes)]
    cases = []
    for index, shape in enumerate(drawn):
        for dtype in DTYPES:
            case = {"collective": collective, "dtype": dtype, "shape": list(shape), "seed": seed + len(cases)}
            if collective in ROOTED:
                case["root"] = (first_root + len(cases)) % world_size
            if collective in REDUCING:  # the first shape sums: a double-counted value hides in a maximum
                case["op"] = draw(st.sampled_from(tuple(OPS))) if index else "sum"
            if collective == "all_to_all":
                case["width"] = shape[-1] if len(shape) > 1 else 1
                rows = st.integers(0, 5) if index else st.just(1)
                case["split_sizes"] = draw(st.lists(st.lists(rows, min_size=world_size, max_size=world_size),
                                                    min_size=world_size, max_size=world_size))
            cases.append(case)
    return cases


# Each collective is a points group of its own, graded on the world sizes that show its algorithm's faults: four
# ranks where a tree or ring has inner ranks, two where the pieces' bookkeeping is what can go wrong.
COLLECTIVE_WORLD_SIZES = {"broadcast": [4], "scatter": [2], "gather": [2], "reduce": [4], "all_gather": [2],
                          "reduce_scatter": [4], "all_reduce": world_sizes(PROBLEM), "all_to_all": [4]}


@marks.points_groups(COLLECTIVE_WORLD_SIZES, "world_size")
@examples(PROBLEM, shrink=False)
@given(data=st.data())
def test_collective(ranks, group, world_size, data):
    cases = data.draw(case_lists(group, world_size), label="cases")
    check_cases(cases, launch(ranks, world_size, cases, world_size), world_size)


@examples(PROBLEM, shrink=False)
@given(data=st.data())
def test_process_groups(ranks, data):
    """Four ranks in two groups of two, each running collectives in its own group at the same time: ranks, roots
    and list indices are group ranks, and nothing may reach the other group."""
    world_size, group_size = 4, 2
    cases = [data.draw(case_lists(name, group_size), label=name)[index]
             for index, name in enumerate(("broadcast", "reduce", "all_gather", "all_reduce", "reduce_scatter"))]
    # Force a root that is not group rank 0, whose global rank differs from its group rank in both groups.
    for case in cases:
        if "root" in case:
            case["root"] = 1
    results = launch(ranks, world_size, cases, group_size, subgroups=True)
    for members in ([0, 2], [1, 3]):
        try:
            check_cases(cases, [results[r] for r in members], group_size)
        except WrongAnswer as error:
            raise WrongAnswer(f"in the group of global ranks {members} (group ranks 0 and 1): {error}") from None


def test_invalid_arguments(ranks):
    world_size = 2
    for rank, outcomes in enumerate(ranks.run(run_invalid_calls, world_size)):
        for description, raised in outcomes:
            if raised is None or "ValueError" not in raised:
                got = "it returned normally" if raised is None else f"it raised {raised[0]}"
                raise WrongAnswer(f"{description} on {world_size} ranks must raise ValueError on every rank; on rank "
                                  f"{rank} {got}")
