"""The entry point of one rank: guards, process group, student module, the grader's program, the result file.

Forked by `grader.distributed.group` inside the launch's sandbox, which calls `main(RUN_DIR)` with
RANK, WORLD_SIZE and LOCAL_RANK set, and, when the grader gave each rank its own inputs, GRADER_RANK_DATA_FD: a
descriptor that only this rank holds, read and closed before the process group forms (so before any rank runs student
code). The grader's program is resolved before the student's module is imported, so replacing it afterwards does not
change what runs; what the program returns is still checked against the grader's own computation, since student code
in the same process could change anything else.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import os
from pathlib import Path

import torch
import torch.distributed as dist

from grader.distributed import recorder
from grader.sandbox import guards
from grader.sandbox.policy import SECRET_VARIABLES
from grader.sandbox.wire import decode, encode, to_plain
from grader.sandbox.worker import describe_exception, guard_reference
from grader.session.packages import PackageSpec, load_problem_module

# What the recorder and the guards import in every rank before student code (about 0.5 s of CPU a rank): the group
# imports them once, before it forks the ranks.
PRELOADED = ("torch.distributed._functional_collectives", "torch.distributed.fsdp", "torch.distributed.device_mesh",
             "torch.distributed.nn.functional", "torch.distributed.optim", "torch.nn.parallel")


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


def run_rank(run_dir: str) -> None:
    run = Path(run_dir)
    for name in SECRET_VARIABLES:
        os.environ.pop(name, None)
    job = decode((run / "job.pt").read_bytes())
    rank, world_size, local_rank = rank_and_world()
    impl = PackageSpec(job["impl_name"], Path(os.environ["GRADER_IMPL_DIR"]))
    result_file = run / f"rank{rank}.result"
    try:
        own = own_inputs()
        recorder.install(run / f"rank{rank}.progress")
        guards.forbid_torch_data_parallel()
        guard_reference(job["reference"], impl)
        module_name, _, function_name = job["program"].partition(":")
        program = getattr(importlib.import_module(module_name), function_name)
        if job["backend"] == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(
            job["backend"],
            # A file in the launch's own folder: no port to choose or collide on, and no connection retried while
            # rank 0 is still starting its server (about 0.6 s a launch with TCP).
            init_method=f"file://{run / 'rendezvous'}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=job["collective_timeout_s"]),
        )
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
