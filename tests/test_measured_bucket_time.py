"""parallel.analysis's bucket step times are compared with the grader's measurement of the student's own bucketed DDP,
over a simulated link whose timing the last test checks.

One sheet answers the step times of a DDP that issues every bucket's all-reduce when the backward has finished (the
backward's 160 ms, then every bucket one after another on the link). Graded beside the reference, whose buckets
overlap the backward, it fails and names the grader's measurement; graded beside the mutant
issues_all_at_end_of_backward, the same sheet passes.
"""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing

from grader.parallel import link
from tests import mutants
from tests.grading import ROOT, assert_fails_for, beside_parallel_sheet, run_grader

# 160 ms of backward, then 8, 4, 2 and 1 buckets of 10 ms latency plus 60 ms per MiB, one after another.
LATE_STEP_MS = {"ddp_step_ms_bucket_0_25mb": 360, "ddp_step_ms_bucket_0_5mb": 320,
                "ddp_step_ms_bucket_1mb": 300, "ddp_step_ms_bucket_2mb": 290}
SELECTION = ("--problem", "parallel.analysis", "-k", "measured_bucket_step_time")


def test_the_step_time_is_measured_on_the_students_ddp(tmp_path):
    reference = (ROOT / "reference" / "parallel" / "ddp_bucketed.py").read_text()
    overlapping = beside_parallel_sheet(tmp_path / "overlapping", "ddp_bucketed", reference, LATE_STEP_MS)
    run = run_grader(overlapping, *SELECTION)
    assert_fails_for(run, "parallel.analysis", "measured_bucket_step_time",
                     "ddp_step_ms_bucket_0_25mb: you wrote 360 ms", "the grader measured")
    late = mutants.load(mutants.WRONG / "parallel" / "ddp_bucketed" / "issues_all_at_end_of_backward")
    run = run_grader(beside_parallel_sheet(tmp_path / "late", "ddp_bucketed", late.source(), LATE_STEP_MS), *SELECTION)
    assert [t["status"] for t in run.tests_of("parallel.analysis")] == ["passed"], run.output[-3000:]


def test_an_unwritten_ddp_leaves_the_question_not_implemented(tmp_path):
    ddp_stub = (ROOT / "student_impl" / "parallel" / "ddp_bucketed.py").read_text()
    run = run_grader(beside_parallel_sheet(tmp_path, "ddp_bucketed", ddp_stub, LATE_STEP_MS), *SELECTION)
    [test] = run.tests_of("parallel.analysis")
    assert test["output"].startswith("not implemented"), run.output[-3000:]
    assert "parallel.ddp_bucketed is not implemented" in test["output"], run.output[-3000:]


def link_timeline(rank: int, port: int, results) -> None:
    """Rank program: two all-reduces issued 5 ms apart, then a broadcast; what each rank saw goes to `results`."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = link.simulated_link_group()
    big, small = torch.full((2**18,), rank + 1.0), torch.full((4,), rank + 1.0)  # 1 MiB and 16 bytes
    dist.barrier()
    started = time.perf_counter()
    first = dist.all_reduce(big, group=group, async_op=True)
    issued_s = time.perf_counter() - started
    time.sleep(0.005)
    second = dist.all_reduce(small, group=group, async_op=True)
    first.wait()
    first_s = time.perf_counter() - started
    second.wait()
    second_s = time.perf_counter() - started
    rooted = torch.full((2,), float(rank))
    dist.broadcast(rooted, src=1, group=group)
    try:
        dist.all_gather([torch.zeros(2), torch.zeros(2)], rooted, group=group)
        refusal = "all_gather ran"
    except NotImplementedError as error:
        refusal = str(error)
    group.close()
    results.put((rank, issued_s, first_s, second_s, big[0].item(), small[0].item(), rooted.tolist(), refusal))
    dist.destroy_process_group()


def test_the_link_carries_one_collective_at_a_time_at_its_modelled_cost():
    """Issuing returns at once; the 1 MiB all-reduce finishes at its cost; the 16-byte one, issued while the link is
    busy, waits for it and then takes its own latency. The values are the real sum and broadcast; another collective
    is refused by name."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=link_timeline, args=(rank, port, results)) for rank in range(2)]
    for process in processes:
        process.start()
    seen = [results.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=30)
    first_cost, second_cost = link.cost_s(2**20), link.cost_s(16)
    for rank, issued_s, first_s, second_s, big, small, rooted, refusal in seen:
        assert issued_s < 0.005, f"rank {rank}: issuing an async all-reduce blocked for {issued_s * 1e3:.1f} ms"
        assert first_cost <= first_s < first_cost + 0.015, (rank, first_s)
        assert first_cost + second_cost <= second_s < first_cost + second_cost + 0.015, (rank, second_s)
        assert (big, small, rooted) == (3.0, 3.0, [1.0, 1.0]), rank
        assert refusal.startswith("the simulated link carries all_reduce and broadcast only"), refusal
