"""The collectives section of the handout: its ring and tree rules, byte counts and printed numbers, checked.

The section (assignment/handout/sections/parallel/collectives.typ) states the ring all-reduce by its index rules (at
reduce-scatter step s rank r sends chunk r - s and adds the incoming chunk r - s - 1; at all-gather step s it sends
chunk r - s + 1 and keeps chunk r - s), proves a claim about what each partial sum holds, and counts the elements each
rank sends, 2 n - |c_r| - |c_(r+1)|. Those rules are restated here as plain Python on lists and compared with the
reference's own functions, run on N ranks as threads of this process: the reference's one message primitive,
`_exchange`, is replaced by queues between the threads, which also log every message a rank sends. No process group
is created and no process is spawned. The worked example's numbers, the binomial tree's example and the self-check's
answers are recomputed the same way.
"""

import math
from pathlib import Path

import pytest
import torch

import reference.parallel.collectives as collectives
from grader.parallel.test_collectives import upper_bounds
from tests.thread_ranks import Messages

SECTION = Path(__file__).resolve().parents[1] / "assignment/handout/sections/parallel/collectives.typ"


def assert_printed(*strings):
    text = " ".join(SECTION.read_text().split())
    for printed in strings:
        assert printed in text, printed


def chunk_sizes(n, world_size):
    return [c.numel() for c in torch.empty(n).tensor_split(world_size)]


def run_ranks(monkeypatch, world_size, program):
    """Run program(rank) on world_size threads that talk through `_exchange`; return (results, sent) where sent[r] is
    the list of (destination, values) rank r sent, in order."""
    ranks = Messages(world_size, monkeypatch)
    return ranks.run(program), ranks.sent


def ring_all_reduce_by_section(inputs):
    """The section's rules on lists of chunks: returns (final chunks per rank, what each rank sends at each step, the
    state after each reduce-scatter step). inputs[r][c] is rank r's chunk c (a list of numbers)."""
    world_size = len(inputs)
    chunks = [[list(c) for c in rank_chunks] for rank_chunks in inputs]
    sends = [[] for _ in range(world_size)]
    after_steps = []
    for s in range(1, world_size):  # reduce-scatter: send chunk r - s, add the incoming chunk r - s - 1
        outgoing = [chunks[r][(r - s) % world_size] for r in range(world_size)]
        for r in range(world_size):
            sends[r].append(((r - s) % world_size, outgoing[r]))
        for r in range(world_size):
            c = (r - s - 1) % world_size
            incoming = outgoing[(r - 1) % world_size]
            chunks[r][c] = [a + b for a, b in zip(chunks[r][c], incoming)]
        after_steps.append([[list(c) for c in rank_chunks] for rank_chunks in chunks])
    for s in range(1, world_size):  # all-gather: send chunk r - s + 1, keep the incoming chunk r - s
        outgoing = [chunks[r][(r - s + 1) % world_size] for r in range(world_size)]
        for r in range(world_size):
            sends[r].append(((r - s + 1) % world_size, outgoing[r]))
        for r in range(world_size):
            chunks[r][(r - s) % world_size] = list(outgoing[(r - 1) % world_size])
    return chunks, sends, after_steps


def split(values, world_size):
    return [c.tolist() for c in torch.tensor(values, dtype=torch.float64).tensor_split(world_size)]


@pytest.mark.parametrize("world_size, n", [(2, 5), (3, 3), (3, 7), (4, 10), (4, 3), (5, 12)])
def test_ring_all_reduce_follows_the_section_rules(monkeypatch, world_size, n):
    """The reference's messages are, in order, the chunks the section's rules name, holding the same partial sums;
    each rank sends 2 n - |c_r| - |c_(r+1)| elements, within 2 (N - 1) ceil(n / N), in 2 (N - 1) steps."""
    generator = torch.Generator().manual_seed(world_size * 100 + n)
    inputs = [torch.randint(-8, 9, (n,), generator=generator).double() for _ in range(world_size)]
    expected_chunks, expected_sends, after_steps = ring_all_reduce_by_section(
        [split(x.tolist(), world_size) for x in inputs])

    def program(rank):
        tensor = inputs[rank].clone()
        collectives.all_reduce(tensor)
        return tensor

    results, sent = run_ranks(monkeypatch, world_size, program)
    sizes = chunk_sizes(n, world_size)
    total = sum(inputs).tolist()
    for r in range(world_size):
        assert results[r].tolist() == total
        assert sum(expected_chunks[r], []) == total
        section = [((r + 1) % world_size, values) for _, values in expected_sends[r] if values]
        assert sent[r] == section
        assert len(expected_sends[r]) == 2 * (world_size - 1)
        count = sum(len(values) for _, values in sent[r])
        assert count == 2 * n - sizes[r] - sizes[(r + 1) % world_size]
        assert count <= 2 * (world_size - 1) * math.ceil(n / world_size)
    # The claim: after step s, rank r's chunk r - s - 1 holds the inputs of ranks r - s, ..., r.
    chunks_in = [split(x.tolist(), world_size) for x in inputs]
    for s, state in enumerate(after_steps, start=1):
        for r in range(world_size):
            c = (r - s - 1) % world_size
            holders = [(r - j) % world_size for j in range(s + 1)]
            assert state[r][c] == [sum(vals) for vals in zip(*(chunks_in[q][c] for q in holders))]


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_reduce_scatter_and_all_gather_send_all_chunks_but_one(monkeypatch, world_size):
    """Reduce-scatter: rank r sends every chunk but its own and keeps chunk r reduced. All-gather: every piece but
    piece r + 1's."""
    n = 2 * world_size + 1
    inputs = [torch.arange(n, dtype=torch.float64) * 10**r for r in range(world_size)]
    sizes = chunk_sizes(n, world_size)

    def scatter_program(rank):
        output = torch.empty(sizes[rank], dtype=torch.float64)
        collectives.reduce_scatter(output, inputs[rank])
        return output

    results, sent = run_ranks(monkeypatch, world_size, scatter_program)
    reduced = sum(inputs).tensor_split(world_size)
    for r in range(world_size):
        assert torch.equal(results[r], reduced[r])
        assert sum(len(v) for _, v in sent[r]) == n - sizes[r]

    def gather_program(rank):
        pieces = [torch.empty(2, dtype=torch.float64) for _ in range(world_size)]
        collectives.all_gather(pieces, torch.full((2,), float(rank), dtype=torch.float64))
        return pieces

    results, sent = run_ranks(monkeypatch, world_size, gather_program)
    for r in range(world_size):
        assert [p.tolist() for p in results[r]] == [[float(q)] * 2 for q in range(world_size)]
        pieces_sent = [int(values[0]) for _, values in sent[r]]
        assert pieces_sent == [(r - s + 1) % world_size for s in range(1, world_size)]
        assert (r + 1) % world_size not in pieces_sent


def test_worked_example_numbers(monkeypatch):
    """x_r[c] = (c + 1) 10^r on three ranks: the sums 202, 33, 110 after step 1 and 111, 222, 333 after step 2, the
    chunks sent at step 1 (3, 10, 200), 16 bytes sent per rank, and 24 bytes in and out of rank 0 for a reduce to
    rank 0 followed by a broadcast from it."""
    inputs = [[(c + 1) * 10**r for c in range(3)] for r in range(3)]
    final, sends, after = ring_all_reduce_by_section([[[v] for v in x] for x in inputs])
    assert [sends[r][0] for r in range(3)] == [(2, [3]), (0, [10]), (1, [200])]
    assert (after[0][0][1], after[0][1][2], after[0][2][0]) == ([202], [33], [110])
    assert [after[1][r][r] for r in range(3)] == [[111], [222], [333]]
    assert all(sum(final[r], []) == [111, 222, 333] for r in range(3))

    def program(rank):
        tensor = torch.tensor(inputs[rank], dtype=torch.float32)
        collectives.all_reduce(tensor)
        return tensor

    results, sent = run_ranks(monkeypatch, 3, program)
    for r in range(3):
        assert results[r].tolist() == [111, 222, 333]
        assert len(sent[r]) == 4 and 4 * sum(len(v) for _, v in sent[r]) == 16

    def naive(rank):
        tensor = torch.tensor(inputs[rank], dtype=torch.float32)
        collectives.reduce(tensor, dst=0)
        collectives.broadcast(tensor, src=0)
        return tensor

    results, sent = run_ranks(monkeypatch, 3, naive)
    assert all(t.tolist() == [111, 222, 333] for t in results)
    assert 4 * sum(len(v) for _, v in sent[0]) == 24
    assert 4 * sum(len(v) for r in (1, 2) for dst, v in sent[r] if dst == 0) == 24
    assert_printed("$2 + 200 = 202$", "$30 + 3 = 33$", "$100 + 10 = 110$", "$1 + 110 = 111$", "$20 + 202 = 222$",
                   "$300 + 33 = 333$", "sends chunk 0 (10) to rank 2", "chunk 1 (200) to rank 0",
                   "four messages of 4 bytes, $16 = 2 dot 2 / 3 dot 12$", "receive 24 bytes and send 24")


def parent_by_section(v):
    return v - (v & -v)


def children_by_section(v, world_size):
    """v + 2^j for every 2^j below lowbit(v) (below N for the root), within N."""
    limit = (v & -v) if v else world_size
    return [v + 2**j for j in range(world_size.bit_length() + 1) if 2**j < limit and v + 2**j < world_size]


@pytest.mark.parametrize("world_size", range(1, 13))
def test_binomial_tree_matches_the_reference(world_size):
    """The section's parent and children are the reference's tree, every rank but the root is a child once, and the
    broadcast takes ceil(log2 N) rounds when each rank sends, one per round, largest subtree first."""
    for v in range(world_size):
        assert children_by_section(v, world_size) == collectives._tree_children(v, world_size)
    assert sorted(c for v in range(world_size) for c in children_by_section(v, world_size)) == list(
        range(1, world_size))
    assert all(parent_by_section(c) == v for v in range(world_size) for c in children_by_section(v, world_size))
    has = {0: 0}  # relative rank -> the round after which it has the tensor
    for v in sorted(range(world_size), key=lambda v: v.bit_count()):
        for i, child in enumerate(reversed(children_by_section(v, world_size))):
            has[child] = has[v] + i + 1
    assert max(has.values()) == math.ceil(math.log2(world_size))


def test_binomial_tree_example_and_self_check(monkeypatch):
    """N = 6: the root sends to relative ranks 4, 2, 1 in that order, 4 to 5, 2 to 3. With src = 2, rank 1 receives
    from rank 0 and rank 2 sends to ranks 0, 4 and 3."""
    assert list(reversed(children_by_section(0, 6))) == [4, 2, 1]
    assert children_by_section(4, 6) == [5] and children_by_section(2, 6) == [3]

    def program(rank):
        tensor = torch.full((2,), 7.0 if rank == 2 else 0.0)
        collectives.broadcast(tensor, src=2)
        return tensor

    results, sent = run_ranks(monkeypatch, 6, program)
    assert all(t.tolist() == [7.0, 7.0] for t in results)
    assert [dst for dst, _ in sent[2]] == [0, 4, 3]
    assert [r for r in range(6) if any(dst == 1 for dst, _ in sent[r])] == [0]
    assert parent_by_section((1 - 2) % 6) == 4
    assert_printed("whose parent is $5 - 1 = 4$, rank $(4 + 2) mod 6 = 0$", "sends to $v = 4, 2, 1$: ranks 0, 4 and 3")


def test_self_check_ten_elements_on_four_ranks(monkeypatch):
    """n = 10 on N = 4: chunks 3, 3, 2, 2; ranks send 14, 15, 16, 15 elements (56 to 64 bytes); bound 18 (72 bytes)."""
    sizes = chunk_sizes(10, 4)
    assert sizes == [3, 3, 2, 2]
    counts = [2 * 10 - sizes[r] - sizes[(r + 1) % 4] for r in range(4)]
    assert counts == [14, 15, 16, 15]
    assert (4 * min(counts), 4 * max(counts)) == (56, 64)
    # The grader's bound on the bytes each rank sends, from the grader itself.
    limits, _, _ = upper_bounds({"collective": "all_reduce", "shape": (10,), "dtype": "float32"}, 4)
    assert limits == [72] * 4 and 4 * max(counts) <= 72

    def program(rank):
        tensor = torch.arange(10, dtype=torch.float32) + rank
        collectives.all_reduce(tensor)
        return tensor

    results, sent = run_ranks(monkeypatch, 4, program)
    assert [sum(len(v) for _, v in sent[r]) for r in range(4)] == counts
    assert all(torch.equal(t, 4 * torch.arange(10, dtype=torch.float32) + 6) for t in results)
    assert_printed("Chunks of 3, 3, 2, 2", "14, 15, 16 and 15 elements (56 to 64 bytes)",
                   "$2 (N - 1) ceil(n \\/ N) = 18$ elements (72 bytes)")
