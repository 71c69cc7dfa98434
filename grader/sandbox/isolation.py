"""The operating-system sandbox around every process that runs student code (workers, ranks, and their children).

Three levels, chosen with `--isolation` (auto picks the strongest this machine supports, checked by a probe):

- `bwrap`: bubblewrap namespaces. New user, pid, ipc, uts, cgroup and network namespaces (a private loopback, shared
  by the ranks of one problem's launches of one package); a read-only view of the system and of the Python
  environment; the grader's worker code (`grader/`, `assignment/`) and a private read-only copy of the student package;
  a private size-capped `/tmp` and `/dev/shm`; GPU device nodes only when grading on a GPU. The reference, the grader's
  other files, run folders of other launches, results and keys are not in the sandbox at all, and no
  grader process is in its pid namespace.
  When the sandbox's first process dies, the kernel kills every process left in its pid namespace, detached daemons
  included.
- `uid`: for a grader running as root where user namespaces are off (e.g. some containers): student processes run
  as an unprivileged user, which the grader checks cannot read the reference or the results key. They still share
  the machine's pid namespace, network and filesystem view.
- `none`: student processes run as the grader's user, guarded only inside their own process (honest mistakes).

Resource limits (processes, file size, core dumps, address space on CPU) apply at every level.
"""

from __future__ import annotations

import functools
import os
import pwd
import resource
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from grader.sandbox.policy import REPOSITORY, student_environment

LEVELS = ("bwrap", "uid", "none")
REQUESTS = ("auto", *LEVELS)
ISOLATION_VARIABLE = "GRADER_ISOLATION"

# What the sandbox sees of the repository: the grader's own code and the registry it reads. Never `reference/`.
CODE_PACKAGES = ("grader", "assignment")

# Paths inside the sandbox.
CODE_DIR = Path("/sandbox/code")
IMPL_ROOT = Path("/sandbox/impl")
RUN_DIR = Path("/sandbox/run")

SANDBOX_USER = "nobody"
TMP_BYTES = 2 << 30
SHM_BYTES = 4 << 30
MAX_PROCESSES = 4096  # threads count too: torch starts one per core in every process
MAX_FILE_BYTES = 4 << 30
def limit_resources(address_space_bytes: int | None) -> None:
    """Run in the child before exec: limits inherited by every process the student's code starts."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    cap = MAX_PROCESSES if hard == resource.RLIM_INFINITY else min(MAX_PROCESSES, hard)
    resource.setrlimit(resource.RLIMIT_NPROC, (cap, cap))
    if address_space_bytes is not None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space_bytes, address_space_bytes))


def physical_memory() -> int:
    """CPU grading caps each student process' address space at the machine's memory. CUDA reserves far more virtual
    memory than it uses, so on a GPU the cap is left to the job's own memory limit."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _system_binds() -> list[str]:
    args = []
    for name in ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "opt"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    return args


def _python_binds() -> list[str]:
    """The interpreter and its packages, read-only, at their own paths (compiled extensions hard-code them)."""
    roots = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), Path(sys.executable).resolve().parent}
    for entry in sys.path:
        path = Path(entry or ".").resolve()
        if path.is_dir() and ("site-packages" in path.parts or "dist-packages" in path.parts):
            roots.add(path)
    chosen = []
    for root in sorted(roots, key=lambda p: len(p.parts)):
        if REPOSITORY.is_relative_to(root):
            continue  # a Python installed above the repository would show the repository (and its reference)
        if not any(root.is_relative_to(c) for c in chosen):
            chosen.append(root)
    args = []
    for root in chosen:
        if not root.is_relative_to("/usr"):
            args += ["--ro-bind", str(root), str(root)]
    return args


def _gpu_binds() -> list[str]:
    args = []
    for device in sorted(Path("/dev").glob("nvidia*")):
        args += ["--dev-bind", str(device), str(device)]
    if args:
        args += ["--ro-bind", "/sys", "/sys"]
    return args


@dataclass(frozen=True)
class Mounts:
    """What one sandbox sees beyond the system: the student package and, for rank launches, its run folder."""

    impl_dir: Path  # the private copy of the student package, mounted read-only at IMPL_ROOT/<name>
    run_dir: Path | None = None  # writable, mounted at RUN_DIR
    extra_code: tuple[Path, ...] = field(default=())  # further read-only code packages (the grader's own tests)


class Isolation:
    """Builds the command and pre-exec step that put a process (and all it starts) into the sandbox."""

    def __init__(self, level: str, gpu: bool = False, address_space_bytes: int | None = None,
                 disable_userns: bool | None = None):
        if level not in LEVELS:
            raise ValueError(f"unknown isolation level {level!r}; choose one of {', '.join(REQUESTS)}")
        self.level = level
        # No user namespaces inside the sandbox (so no nested sandbox to escape its limits from), where the kernel can
        # say so; the probe finds out.
        self.disable_userns = _NESTED_USERNS_CAN_BE_DISABLED[0] if disable_userns is None else disable_userns
        self.gpu = gpu
        self.address_space_bytes = address_space_bytes
        self._scratch: Path | None = None

    # --- where the student package is seen from inside ------------------------------------------------------------

    def impl_path(self, impl_dir: Path) -> Path:
        return IMPL_ROOT / impl_dir.name if self.level == "bwrap" else impl_dir

    def run_path(self, run_dir: Path) -> Path:
        return RUN_DIR if self.level == "bwrap" else run_dir

    # --- starting a process ---------------------------------------------------------------------------------------

    def command(self, argv: list[str], mounts: Mounts) -> list[str]:
        if self.level != "bwrap":
            return argv
        args = [
            bwrap_path(), "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--uid", "65534", "--gid", "65534", "--hostname", "sandbox",
            *(["--disable-userns"] if self.disable_userns else []),
            *_system_binds(), *_python_binds(),
            "--proc", "/proc", "--dev", "/dev",
            "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm",
            "--size", str(TMP_BYTES), "--tmpfs", "/tmp",
        ]
        if self.gpu:
            args += _gpu_binds()
        for package in CODE_PACKAGES:
            args += ["--ro-bind", str(REPOSITORY / package), str(CODE_DIR / package)]
        for code in mounts.extra_code:
            args += ["--ro-bind", str(code), str(CODE_DIR / code.name)]
        args += ["--ro-bind", str(mounts.impl_dir), str(IMPL_ROOT / mounts.impl_dir.name)]
        if mounts.run_dir is not None:
            args += ["--bind", str(mounts.run_dir), str(RUN_DIR)]
        args += ["--chdir", "/tmp", "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp",
                 "--setenv", "TRITON_CACHE_DIR", "/tmp/triton", "--setenv", "PYTHONPATH", str(CODE_DIR),
                 "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--"]
        return args + argv

    def environment(self) -> dict[str, str]:
        env = student_environment()
        if self.level == "uid":
            scratch = str(self.scratch())
            env.update(HOME=scratch, TMPDIR=scratch, TRITON_CACHE_DIR=f"{scratch}/triton", PYTHONDONTWRITEBYTECODE="1")
        return env

    def scratch(self) -> Path:
        """At the `uid` level, a private writable folder of the sandbox user's (its home, temporary files and Triton
        cache), so that no two gradings share one; removed by close()."""
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="grader-sandbox-"))
            user = pwd.getpwnam(SANDBOX_USER)
            os.chown(self._scratch, user.pw_uid, user.pw_gid)
        return self._scratch

    def close(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def preexec(self):
        """The function Popen runs in the child before exec: limits, and for `uid` the switch of user."""
        return functools.partial(_prepare_child, self.level, self.address_space_bytes)

    def popen(self, argv: list[str], mounts: Mounts, *, pass_fds: tuple[int, ...] = (), env: dict | None = None,
              **kwargs) -> subprocess.Popen:
        environment = self.environment()
        environment.update(env or {})
        if self.level == "uid":
            kwargs.setdefault("cwd", str(self.scratch()))  # not the grader's folder
        return subprocess.Popen(
            self.command(argv, mounts), pass_fds=pass_fds, env=environment,
            preexec_fn=self.preexec(), start_new_session=True, **kwargs,
        )

    def grant(self, path: Path) -> None:
        """Let the sandbox user write `path` (a run folder) at the `uid` level; nothing to do otherwise."""
        if self.level == "uid":
            user = pwd.getpwnam(SANDBOX_USER)
            os.chown(path, user.pw_uid, user.pw_gid)


def _prepare_child(level: str, address_space_bytes: int | None) -> None:
    limit_resources(address_space_bytes)
    if level == "uid":
        user = pwd.getpwnam(SANDBOX_USER)
        os.setgroups([])
        os.setgid(user.pw_gid)
        os.setuid(user.pw_uid)


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise RuntimeError("bubblewrap (bwrap) is not installed: see the README's 'Isolation' section")
    return path


_NESTED_USERNS_CAN_BE_DISABLED = [True]


@functools.cache
def bwrap_works() -> tuple[bool, str]:
    """Whether a bubblewrap sandbox starts here (user namespaces allowed, bwrap installed); why not, if it does not.
    Some kernels (gVisor's, say) cannot refuse user namespaces inside the sandbox: then it starts without that."""
    if shutil.which("bwrap") is None:
        return False, "bwrap is not installed"
    for disable_userns in (True, False):
        _NESTED_USERNS_CAN_BE_DISABLED[0] = disable_userns
        sandbox = Isolation("bwrap", disable_userns=disable_userns)
        probe = sandbox.command([sys.executable, "-c", "import torch"], Mounts(impl_dir=REPOSITORY / "grader"))
        try:
            completed = subprocess.run(probe, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as error:
            return False, f"bwrap did not start: {error}"
        if completed.returncode == 0:
            return True, ""
    lines = completed.stderr.strip().splitlines()
    return False, f"bwrap failed: {lines[-1] if lines else f'exit status {completed.returncode}'}"


def choose(requested: str) -> tuple[str, str]:
    """The level to use for `--isolation requested`, and a note when it is weaker than bwrap."""
    if requested not in REQUESTS:
        raise ValueError(f"--isolation takes one of {', '.join(REQUESTS)}, not {requested!r}")
    if requested == "none":
        return "none", "student code runs as the grader's user (no sandbox)"
    if requested in ("auto", "bwrap"):
        works, why = bwrap_works()
        if works:
            return "bwrap", ""
        if requested == "bwrap":
            raise RuntimeError(f"--isolation bwrap: {why}")
        why_not_uid = uid_unavailable()
        if why_not_uid is None:
            return "uid", f"no bwrap sandbox ({why}): student code runs as the user {SANDBOX_USER!r}"
        return "none", f"no bwrap sandbox ({why}), no uid level ({why_not_uid}): student code runs as the grader's user"
    why_not_uid = uid_unavailable()
    if why_not_uid is not None:
        raise RuntimeError(f"--isolation uid: {why_not_uid}")
    return "uid", f"student code runs as the user {SANDBOX_USER!r}"


def uid_unavailable() -> str | None:
    """Why student code cannot run as the sandbox user here; None if it can."""
    if os.geteuid() != 0:
        return "switching to an unprivileged user needs the grader to run as root"
    if unreadable_by_sandbox_user(Path(sys.executable), execute=True):
        return f"the user {SANDBOX_USER!r} cannot run this Python ({sys.executable})"
    return None


def unreadable_by_sandbox_user(path: Path, execute: bool = False) -> bool:
    """Whether the `uid` level's user is kept out of `path` (from reading it, or running it) by a directory on the way
    or the file itself. Owner and group bits are not considered: the sandbox user owns nothing and is in no group."""
    for part in [*reversed(path.resolve().parents), path.resolve()]:
        try:
            mode = part.stat().st_mode
        except OSError:
            return True
        needed = 0o001 if part.is_dir() or execute else 0o004
        if not mode & needed:
            return True
    return False
