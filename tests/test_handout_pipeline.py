"""The pipeline section of the handout: its schedules, bubble, activation counts, worked example and self-check.

Algorithm 1 (warm-up, steady state, cool-down; GPipe as w = m) is written out here and compared with the reference's
own schedule builder. A simulation runs every stage's events in that order, a forward waiting for the previous
stage's forward of its micro-batch and a backward for the next stage's backward (communication free, as the section
assumes), and checks the bubble's derivation: the step lasts (m + p - 1)(t_f + t_b), the last stage never waits once
started, every stage idles (p - 1)(t_f + t_b), and GPipe's idle time splits as s t_f, (p - 1 - s)(t_f + t_b), s t_b.
The peaks of activations held are counted from the orders. The worked example (p = 3, m = 4, one slot per event) is
hard-coded as the section prints it. The sends per stage are counted on the reference's `pipeline_step`, run in
threads over a stand-in for torch.distributed's point-to-point calls, whose gradients and loss are also compared
with one process's.
"""

import queue
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import reference.parallel.pipeline as pipeline
from reference.parallel.pipeline import _schedule_order, bubble_fraction, pipeline_step_torch
from tests.thread_ranks import ThreadRanks

SECTION = Path(__file__).resolve().parents[1] / "assignment/handout/sections/parallel/pipeline.typ"

SHAPES = [(p, m) for p in range(1, 7) for m in range(1, 10)]
TIMES = [(1, 1), (1, 2), (2, 1), (2, 3)]


def algorithm_1(schedule, p, s, m):
    """Algorithm 1's order of events on stage s: warm-up, steady state, cool-down; GPipe is the same with w = m."""
    w = m if schedule == "gpipe" else min(p - s - 1, m)
    warm_up = [("F", i) for i in range(w)]
    steady = [event for i in range(m - w) for event in (("F", w + i), ("B", i))]
    cool_down = [("B", i) for i in range(m - w, m)]
    return warm_up + steady + cool_down


def simulate(schedule, p, m, tf, tb):
    """Start times of every stage's events, each stage running its events in order as soon as their input exists."""
    orders = [algorithm_1(schedule, p, s, m) for s in range(p)]
    starts = [[None] * len(order) for order in orders]
    finish, position, free = {}, [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while position[s] < len(orders[s]):
                kind, i = orders[s][position[s]]
                if kind == "F":
                    needs = None if s == 0 else ("F", s - 1, i)
                else:
                    needs = ("F", s, i) if s == p - 1 else ("B", s + 1, i)
                if needs is not None and needs not in finish:
                    break
                start = max(free[s], finish[needs] if needs else 0)
                starts[s][position[s]] = start
                free[s] = start + (tf if kind == "F" else tb)
                finish[(kind, s, i)] = free[s]
                position[s] += 1
                progress = True
    assert all(position[s] == len(orders[s]) for s in range(p)), "the schedule deadlocks"
    return orders, starts, max(free)


def warm_up(order):
    """The forwards a stage runs before its first backward."""
    return [kind for kind, _ in order].index("B")


def peak_held(order):
    """Forwards minus backwards after each prefix of a stage's events, at its largest."""
    held = peak = 0
    for kind, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_algorithm_1_gives_the_reference_orders(schedule):
    for p, m in SHAPES:
        for s in range(p):
            assert algorithm_1(schedule, p, s, m) == _schedule_order(schedule, p, s, m), (p, s, m)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_step_lasts_m_plus_p_minus_1_rounds_and_every_stage_idles_the_bubble(schedule):
    for p, m in SHAPES:
        for tf, tb in TIMES:
            orders, starts, step = simulate(schedule, p, m, tf, tb)
            assert step == (m + p - 1) * (tf + tb)
            for order in orders:
                busy = sum(tf if kind == "F" else tb for kind, _ in order)
                assert busy == m * (tf + tb)
                assert step - busy == (p - 1) * (tf + tb)
                assert Fraction(step - busy, step) == Fraction(p - 1, m + p - 1)
            assert bubble_fraction(p, m) == pytest.approx((p - 1) / (m + p - 1), abs=1e-15)
            # The lower bound's argument: the last stage starts at (p - 1) t_f and then never waits.
            last = [(start, tf if kind == "F" else tb) for (kind, _), start in zip(orders[-1], starts[-1])]
            assert last[0][0] == (p - 1) * tf
            assert all(a + d == b for (a, d), (b, _) in zip(last, last[1:]))
            assert last[-1][0] + last[-1][1] + (p - 1) * tb == step


def test_gpipe_idle_time_splits_into_fill_middle_and_drain():
    for p, m in SHAPES:
        for tf, tb in TIMES:
            orders, starts, step = simulate("gpipe", p, m, tf, tb)
            for s in range(p):
                first_forward = starts[s][0]
                last_forward_end = starts[s][m - 1] + tf
                first_backward = starts[s][m]
                last_backward_end = starts[s][-1] + tb
                assert first_forward == s * tf
                assert first_backward - last_forward_end == (p - 1 - s) * (tf + tb)
                assert step - last_backward_end == s * tb


def test_peak_activations_are_m_under_gpipe_and_min_p_minus_s_m_under_1f1b():
    for p, m in SHAPES:
        for s in range(p):
            assert peak_held(_schedule_order("gpipe", p, s, m)) == m
            assert peak_held(_schedule_order("1f1b", p, s, m)) == min(p - s, m)
        assert max(peak_held(_schedule_order("1f1b", p, s, m)) for s in range(p)) == min(p, m)  # stage 0's


def slot_rows(schedule, p, m):
    """Each stage's 12 slots as the figure draws them: the event in the slot, or '.' when idle."""
    orders, starts, step = simulate(schedule, p, m, 1, 1)
    rows = []
    for order, start in zip(orders, starts):
        row = ["."] * step
        for (kind, i), t in zip(order, start):
            row[t] = f"{kind}{i}"
        rows.append(" ".join(row))
    return rows, step


def test_worked_example_p3_m4():
    p, m = 3, 4
    gpipe, step = slot_rows("gpipe", p, m)
    assert step == 12
    assert gpipe == [
        "F0 F1 F2 F3 . . . . B0 B1 B2 B3",
        ". F0 F1 F2 F3 . . B0 B1 B2 B3 .",
        ". . F0 F1 F2 F3 B0 B1 B2 B3 . .",
    ]
    one_f_one_b, step = slot_rows("1f1b", p, m)
    assert step == 12
    assert one_f_one_b == [
        "F0 F1 F2 . . B0 F3 B1 . B2 . B3",
        ". F0 F1 . B0 F2 B1 F3 B2 . B3 .",
        ". . F0 B0 F1 B1 F2 B2 F3 B3 . .",
    ]
    # Forwards before the first backward: the warm-up's w = p - s - 1, then the steady state's first forward.
    assert [warm_up(_schedule_order("1f1b", p, s, m)) for s in range(p)] == [3, 2, 1]
    for rows in (gpipe, one_f_one_b):
        assert [row.split().count(".") for row in rows] == [4, 4, 4]
        assert bubble_fraction(p, m) == pytest.approx(4 / 12)
    assert [t for t, e in enumerate(one_f_one_b[0].split()) if e == "."] == [3, 4, 8, 10]
    assert [t for t, e in enumerate(gpipe[0].split()) if e == "."] == [4, 5, 6, 7]
    assert one_f_one_b[0].split().index("B0") == 5  # F0 through three stages, B0 back up two
    assert [peak_held(_schedule_order("gpipe", p, s, m)) for s in range(p)] == [4, 4, 4]
    assert [peak_held(_schedule_order("1f1b", p, s, m)) for s in range(p)] == [3, 2, 1]


def test_self_check_bubble_peaks_and_memory():
    orders, _, step = simulate("1f1b", 8, 32, 1, 1)
    assert Fraction(step - len(orders[0]), step) == Fraction(7, 39)  # each stage idle for the rest of the step
    assert round(bubble_fraction(8, 32) * 100, 1) == 17.9
    assert peak_held(_schedule_order("1f1b", 8, 0, 32)) == 8
    assert peak_held(_schedule_order("1f1b", 8, 7, 32)) == 1
    gib = [peak_held(_schedule_order(schedule, 8, 0, 32)) * 1.5 for schedule in ("gpipe", "1f1b")]
    assert gib == [48, 12]
    text = " ".join(SECTION.read_text().split())
    for printed in ("(1) $7 slash 39 approx 17.9%$; 8 and 1; 48 GiB and 12 GiB",
                    "Stages 0 and 1 ($w = 3, 2$): $F_0 F_1 F_2 B_0 B_1 B_2$, GPipe's; "
                    "stage 2: $F_0 F_1 B_0 F_2 B_1 B_2$; stage 3: $F_0 B_0 F_1 B_1 F_2 B_2$",
                    "(3) $m$ on the end stages, $2 m$ in between", "$2 m (p - 1) = 48$ in all"):
        assert printed in text, printed


def test_self_check_orders_coincide_with_gpipe_exactly_when_m_at_most_p_minus_s():
    orders = [" ".join(f"{k}{i}" for k, i in _schedule_order("1f1b", 4, s, 3)) for s in range(4)]
    assert orders == ["F0 F1 F2 B0 B1 B2", "F0 F1 F2 B0 B1 B2", "F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"]
    for p, m in SHAPES:
        for s in range(p):
            same = _schedule_order("1f1b", p, s, m) == _schedule_order("gpipe", p, s, m)
            assert same == (m <= p - s), (p, s, m)


class PointToPoint(ThreadRanks):
    """torch.distributed's isend/recv for stages run as threads of one process: a queue per (source, destination).
    Not `tests.thread_ranks.Messages`, which replaces the collectives module's own batched `_exchange`: the pipeline
    calls torch.distributed's point-to-point functions directly, and the test counts its isends."""

    def __init__(self, world):
        super().__init__(world)
        self.channels = {(a, b): queue.Queue() for a in range(world) for b in range(world)}
        self.sends = [0] * world

    def isend(self, tensor, dst, group=None):
        self.sends[self.local.rank] += 1
        self.channels[(self.local.rank, dst)].put(tensor.clone())

        class Done:
            def wait(self):
                return True

        return Done()

    def recv(self, tensor, src, group=None):
        tensor.copy_(self.channels[(src, self.local.rank)].get(timeout=20))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_self_check_sends_per_stage_on_the_reference(monkeypatch, schedule):
    p, m, rows, width = 4, 8, 16, 3
    fake = PointToPoint(p)
    monkeypatch.setattr(pipeline, "dist", fake)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width, dtype=torch.float64) for _ in range(p)]
    inputs = torch.randn(rows, width, dtype=torch.float64)
    targets = torch.randn(rows, width, dtype=torch.float64)
    stages = [torch.nn.Linear(width, width, dtype=torch.float64) for _ in range(p)]
    for stage, layer in zip(stages, layers):
        stage.load_state_dict(layer.state_dict())
    losses = fake.run(lambda s: pipeline.pipeline_step(
        stages[s], inputs if s == 0 else None, targets if s == p - 1 else None, m, schedule, (rows // m, width),
        torch.nn.functional.mse_loss))
    assert fake.sends == [m, 2 * m, 2 * m, m]
    assert sum(fake.sends) == 48
    loss = pipeline_step_torch(layers, inputs, targets, torch.nn.functional.mse_loss)
    assert torch.allclose(losses[-1], loss, rtol=1e-12, atol=1e-12)
    for stage, layer in zip(stages, layers):
        assert torch.allclose(stage.weight.grad, layer.weight.grad, rtol=1e-10, atol=1e-12)
