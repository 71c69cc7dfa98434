"""The entry point of one rank: guards, process group, student module, the grader's program, the result file.

Run by every launcher (as `python -m grader.distributed.rank RUN_DIR`, or called through submitit). The rank's index
and the world size come from the launcher's variables: RANK/WORLD_SIZE, submitit's job environment, or Slurm's
SLURM_PROCID/SLURM_NTASKS.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from grader.distributed import recorder
from grader.packages import PackageSpec, load_problem_module
from grader.sandbox import guards
from grader.sandbox.client import SECRET_VARIABLES
from grader.sandbox.wire import decode, encode, to_plain
from grader.sandbox.worker import describe_exception


def rank_and_world() -> tuple[int, int, int]:
    """(global rank, world size, local rank) from torchrun-style or Slurm variables."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if "SUBMITIT_EXECUTOR" in os.environ:
        import submitit

        environment = submitit.JobEnvironment()
        return environment.global_rank, environment.num_tasks, environment.local_rank
    if "SLURM_PROCID" in os.environ:
        return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]), int(os.environ["SLURM_LOCALID"])
    raise RuntimeError("no rank variables: RANK/WORLD_SIZE, submitit's or SLURM_PROCID/SLURM_NTASKS")


def rank_device() -> torch.device:
    """The device a rank program computes on: its own GPU under NCCL, the CPU under gloo."""
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def write(path: Path, message: dict) -> None:
    temporary = path.with_suffix(".partial")
    temporary.write_bytes(encode(message))
    temporary.rename(path)  # whole or absent: the launcher never reads half a file


def run_rank(run_dir: str) -> None:
    run = Path(run_dir)
    for name in SECRET_VARIABLES:
        os.environ.pop(name, None)
    job = decode((run / "job.pt").read_bytes())
    rank, world_size, local_rank = rank_and_world()
    impl = PackageSpec.from_json(job["impl"])
    result_file = run / f"rank{rank}.result"
    try:
        recorder.install(run / f"rank{rank}.progress")
        guards.forbid_torch_data_parallel()
        reference = PackageSpec.from_json(job["reference"])
        if reference.path != impl.path:
            # By name too, unless the graded package has the reference's name (a copy of it, say).
            guards.block_reference(reference.name if reference.name != impl.name else None, reference.path)
        if job["backend"] == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(
            job["backend"],
            init_method=f"tcp://{job['master_addr']}:{job['master_port']}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=job["collective_timeout_s"]),
        )
        student = load_problem_module(impl, job["problem"])
        module_name, _, function_name = job["program"].partition(":")
        program = getattr(importlib.import_module(module_name), function_name)
        value = program(student, rank, world_size, *job["args"], **job["kwargs"])
        write(result_file, {"status": "ok", "value": to_plain(value)})
    except BaseException as error:  # noqa: BLE001 - reported to the launcher, which decides the verdict
        write(result_file, describe_exception(error, impl.path))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    faulthandler.enable()
    sys.path.insert(0, str(Path.cwd()))
    run_rank(sys.argv[1])
    # Skip interpreter teardown: a student's leftover threads or handles must not hang the exit.
    os._exit(0)


if __name__ == "__main__":
    main()
