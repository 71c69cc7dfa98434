"""Programs the launcher tests run on several ranks: program(student_module, rank, world_size, *args)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def sum_of_ranks(student, rank, world_size):
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return {"rank": rank, "world_size": world_size, "sum": value}


def rank_one_skips_a_collective(student, rank, world_size):
    value = torch.ones(1)
    dist.all_reduce(value)
    if rank != 1:
        dist.all_reduce(value)
    return value


def rank_one_hangs(student, rank, world_size):
    value = torch.ones(1)
    dist.all_reduce(value)
    if rank == 1:
        time.sleep(3600)
    dist.all_reduce(value)
    return value


def rank_one_raises(student, rank, world_size):
    if rank == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()
    return rank


def rank_one_dies(student, rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.barrier()
    return rank


def own_data_and_what_peers_can_see(student, rank, world_size, rank_data):
    dist.barrier()  # every rank has read its own inputs
    open_elsewhere = []
    for link in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if "data.pt" in os.readlink(link):
                open_elsewhere.append(str(link))
        except OSError:
            continue
    return {"own": rank_data, "descriptors_of_peers": open_elsewhere}


def rank_zero_leaves_a_daemon(student, rank, world_size, marker):
    if rank == 0:  # detached: its own session, its parent gone when the rank exits
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True,
                         env={**os.environ, "LEFTOVER": marker})
    dist.barrier()
    return rank
