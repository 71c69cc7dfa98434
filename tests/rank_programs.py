"""Programs the launcher tests run on several ranks: program(student_module, rank, world_size, *args)."""

import os
import secrets
import subprocess
import sys
import tempfile
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


def what_rank_code_sees_of_the_store(student, rank, world_size):
    """What code in a rank, run after the student's module is imported, can learn of the process group's store: the
    variables that could name one, what ProcessGroup.get_group_store gives, and the files it can find by listing its
    temporary files and its launch's folder that hold a value this program put in the store (through torch's private
    route: grader code, which the source policy does not read)."""
    marker = secrets.token_hex(16)
    dist.distributed_c10d._get_default_store().set(f"marker{rank}", marker)
    try:
        dist.group.WORLD.get_group_store()
        refusal = None
    except RuntimeError as error:
        refusal = str(error)
    launch_folder = Path("/proc/self/fd/1").resolve().parent  # the rank's log is there
    holding = [str(path) for folder in (Path(tempfile.gettempdir()), launch_folder) for path in files_under(folder)
               if marker.encode() in path.read_bytes()]
    dist.barrier()
    variables = ("MASTER_ADDR", "MASTER_PORT", "GRADER_STORE_PATH")
    return {"environment": {name: os.environ[name] for name in variables if name in os.environ},
            "get_group_store": refusal, "files_holding_the_store": holding}


def files_under(folder: Path) -> list[Path]:
    """The regular files under `folder` that this process can list and read."""
    found = []
    for parent, _, names in os.walk(folder):  # folders it cannot list are skipped
        for name in names:
            path = Path(parent) / name
            if path.is_file() and os.access(path, os.R_OK):
                found.append(path)
    return found
