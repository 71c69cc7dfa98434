"""The entry point of one rank: guards, process group, student module, the grader's program, the result file.

Forked by `grader.ranks.group` inside the launch's sandbox, which calls `main(RUN_DIR)` with
RANK, WORLD_SIZE and LOCAL_RANK set, STORE_PATH_VARIABLE (where the launch's c10d store lives) and, when the grader
gave each rank its own inputs, GRADER_RANK_DATA_FD: a descriptor that only this rank holds, read and closed before the
process group forms (so before any rank runs student code). The grader's program is resolved before the student's
module is imported, so replacing it afterwards does not change what runs; what the program returns is still checked
against the grader's own computation, since student code in the same process could change anything else.

The process group's store belongs to this setup alone. Its file has a name drawn at random for the launch, in a folder
the ranks cannot list (grader.ranks.group.launch_store); the path leaves the environment before the group forms
and stays in no variable of this module; no variable of the environment names a store (MASTER_ADDR and MASTER_PORT are
removed, should the grader's own environment hold them); and ProcessGroup.get_group_store, the one public method that
hands a group's store out, is refused. What remains is in-process, through what the source policy refuses: torch's
private state holds the store (torch.distributed.distributed_c10d._get_default_store()), the rank's memory holds the
path, and the folder is the ranks' own, so a rank could give itself back the right to list it (os.chmod). Collectives
graded on bytes are graded on lower bounds too, which data carried through the store, or any other way around send and
recv, does not meet.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import os
from pathlib import Path

import torch
import torch.distributed as dist

from grader.ranks import GROUP_SETUP, recorder
from grader.sandbox import guards
from grader.sandbox.policy import SECRET_VARIABLES
from grader.sandbox.wire import decode, encode, to_plain
from grader.sandbox.worker import describe_exception, guard_reference
from grader.session.packages import PackageSpec, load_problem_module

# What the recorder and the guards import in every rank before student code (about 0.5 s of CPU a rank): the group
# imports them once, before it forks the ranks.
PRELOADED = ("torch.distributed._functional_collectives", "torch.distributed.fsdp", "torch.distributed.device_mesh",
             "torch.distributed.nn.functional", "torch.distributed.optim", "torch.nn.parallel")


# Where the launch's store is: set by the group process for the ranks it forks, and taken out of the environment by
# each rank before the process group forms.
STORE_PATH_VARIABLE = "GRADER_STORE_PATH"
# What torch's env:// rendezvous and a TCPStore client would read to reach a store: nothing of this launch, but an
# instructor's job script may export them, and student code has no business with any store.
STORE_ADDRESS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT")


def rank_and_world() -> tuple[int, int, int]:
    """(global rank, world size, local rank), set by the launch's group process."""
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def rank_device() -> torch.device:
    """The device a rank program computes on: its own GPU under NCCL, the CPU under gloo."""
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def write(path: Path, message: dict) -> None:
    temporary = path.with_suffix(".partial")
    temporary.write_bytes(encode(message))
    temporary.rename(path)  # whole or absent: the launcher never reads half a file


def own_inputs() -> dict:
    """This rank's own inputs, if the grader gave it any: {"rank_data": ...}."""
    fd = os.environ.pop("GRADER_RANK_DATA_FD", None)
    if fd is None:
        return {}
    with os.fdopen(int(fd), "rb") as handle:
        return {"rank_data": decode(handle.read())}


def join_group(backend: str, rank: int, world_size: int, timeout_s: float) -> None:
    """The process group, over a FileStore at the launch's store path, which leaves the environment here. A file, not
    a TCPStore: no port to choose or collide on, and no connection retried while rank 0 is still starting its server
    (about 0.6 s a launch). Given as `store`, not as an init_method that torch would keep as text, the store object is
    then held by torch alone."""
    store = dist.FileStore(os.environ.pop(STORE_PATH_VARIABLE), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def refuse_group_stores() -> None:
    """ProcessGroup.get_group_store hands any group's store to whoever holds the group, as every collective's caller
    does; torch itself calls it only in split_group, which no grader program uses."""

    def get_group_store(group, *args, **kwargs):
        raise RuntimeError("the process group's store belongs to the grader's setup: exchange data with send and recv")

    dist.ProcessGroup.get_group_store = get_group_store


def run_rank(run_dir: str) -> None:
    run = Path(run_dir)
    for name in (*SECRET_VARIABLES, *STORE_ADDRESS_VARIABLES):
        os.environ.pop(name, None)
    job = decode((run / "job.pt").read_bytes())
    rank, world_size, local_rank = rank_and_world()
    impl = PackageSpec(job["impl_name"], Path(os.environ["GRADER_IMPL_DIR"]))
    result_file = run / f"rank{rank}.result"
    try:
        own = own_inputs()
        recorder.install(run / f"rank{rank}.progress")
        guards.forbid_torch_data_parallel()
        refuse_group_stores()
        guard_reference(job["reference"], impl)
        module_name, _, function_name = job["program"].partition(":")
        program = getattr(importlib.import_module(module_name), function_name)
        if job["backend"] == "nccl":
            torch.cuda.set_device(local_rank)
        try:
            join_group(job["backend"], rank, world_size, job["collective_timeout_s"])
        except Exception as error:  # noqa: BLE001 - before any student code: the launch failed, not the student
            write(result_file, {**describe_exception(error, impl.path), "kind": GROUP_SETUP})
            return
        student = load_problem_module(impl, job["problem"])
        value = program(student, rank, world_size, *job["args"], **job["kwargs"], **own)
        write(result_file, {"status": "ok", "value": to_plain(value)})
    except BaseException as error:  # noqa: BLE001 - reported to the launcher, which decides the verdict
        write(result_file, describe_exception(error, impl.path))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(run_dir: str) -> None:
    faulthandler.enable()
    run_rank(run_dir)
    # Skip interpreter teardown: a student's leftover threads or handles must not hang the exit.
    os._exit(0)
