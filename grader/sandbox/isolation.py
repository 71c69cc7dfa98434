"""The operating-system sandbox around every process that runs student code (workers, ranks, and their children).

Three levels, chosen with `--isolation` (auto picks the strongest this machine supports, checked by a probe):

- `bwrap`: bubblewrap namespaces. New pid, ipc, uts, cgroup and network namespaces (a private loopback, shared by the
  ranks of one problem's launches of one package); a read-only view of the system (of /etc only what the linker and
  name resolution read) and of the Python environment; the grader's worker code (`grader/`, `assignment/`) and a
  private read-only copy of the student package; a private size-capped `/tmp` and `/dev/shm`; GPU device nodes only
  when grading on a GPU. The reference, the grader's other files, run folders of other launches, results, keys and
  site files are not in the sandbox at all, and no grader process is in its pid namespace. Student code is never root
  outside: a root grader's sandbox runs as a uid of its own (grader.sandbox.uids), a non-root grader's in a user
  namespace mapped to the grader's uid.
  When the sandbox's first process dies, the kernel kills every process left in its pid namespace, detached daemons
  included.
- `uid`: for a grader running as root where bwrap cannot run (e.g. some containers): student processes run as an
  unprivileged uid of their own, which the grader checks cannot read the reference or the results key. They still
  share the machine's pid namespace, network and filesystem view.
- `none`: student processes run as the grader's user, guarded only inside their own process (honest mistakes).

Resource limits (file size, core dumps, address space on CPU) apply at every level, and processes and threads per
sandbox; a root grader also gives each sandbox a control group where the machine offers one (grader.sandbox.cgroup),
which caps the sandbox's processes and memory together.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from grader.sandbox import cgroup
from grader.sandbox.cgroup import ControlGroup
from grader.sandbox.policy import REPOSITORY, student_environment
from grader.sandbox.uids import SandboxUid

LEVELS = ("bwrap", "uid", "none")
REQUESTS = ("auto", *LEVELS)
ISOLATION_VARIABLE = "GRADER_ISOLATION"

# What the sandbox sees of the repository: the grader's own code and the registry it reads. Never `reference/`.
CODE_PACKAGES = ("grader", "assignment")

# Paths inside the sandbox.
CODE_DIR = Path("/sandbox/code")
IMPL_ROOT = Path("/sandbox/impl")
RUN_DIR = Path("/sandbox/run")

SANDBOX_USER = "sandbox"  # the name student code sees for itself (the sandbox's own /etc/passwd)
TMP_BYTES = 2 << 30
SHM_BYTES = 4 << 30
MAX_PROCESSES = 4096  # per sandbox; threads count too: torch starts one per core in every process
MAX_FILE_BYTES = 4 << 30
# Of /etc, only what the dynamic linker, name resolution and the C compiler Triton builds its launchers with (reached
# through /etc/alternatives) read: a site file, keys or /etc/shadow are not there to be read.
ETC_ENTRIES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf", "hosts", "localtime", "alternatives")
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# What a root grader runs inside its sandbox before the student's process: the switch to the sandbox's own uid, with
# every capability and privilege gain given up.
DROP_TO_UID = ("--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs")


def limit_resources(address_space_bytes: int | None, max_processes: int | None) -> None:
    """Run in the child before exec: limits inherited by every process the student's code starts. The process limit
    counts the processes of a uid; where it is set inside the sandbox instead (None), see Isolation.command."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
    if max_processes is not None:
        cap = process_cap(max_processes)
        resource.setrlimit(resource.RLIMIT_NPROC, (cap, cap))
    if address_space_bytes is not None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space_bytes, address_space_bytes))


def process_cap(max_processes: int) -> int:
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    return max_processes if hard == resource.RLIM_INFINITY else min(max_processes, hard)


def physical_memory() -> int:
    """CPU grading caps each student process' address space at the machine's memory. CUDA reserves far more virtual
    memory than it uses, so on a GPU the cap is left to the sandbox's control group and the job's memory limit."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def sandbox_memory() -> int:
    """What one sandbox's processes may hold together, where a control group keeps count: enough for any honest
    problem, and a quarter of the machine left to the grader and the other sandboxes."""
    return physical_memory() * 3 // 4


class View:
    """A sandbox's file system as bwrap arguments. Every folder on the way to a mount is made explicitly, readable by
    all: the sandbox's uid must pass through it, and one bwrap made on its own (/root on the way to a Python in
    /root/.pyenv, say) would copy the host folder's mode."""

    def __init__(self):
        self.args: list[str] = []
        self.sources: list[Path] = []  # the host paths mounted
        self._made = {Path("/")}
        self._read_only: list[Path] = []  # inside these nothing can be made

    def bind(self, source: Path, dest: Path, option: str = "--ro-bind") -> None:
        self._parents(dest)
        self.args += [option, str(source), str(dest)]
        self.sources.append(source)
        self._made.add(dest)
        if option != "--bind":
            self._read_only.append(dest)

    def symlink(self, target: str, dest: Path) -> None:
        self._parents(dest)
        self.args += ["--symlink", target, str(dest)]
        self._read_only.append(dest)

    def tmpfs(self, dest: Path, size: int) -> None:
        self._parents(dest)
        self.args += ["--perms", "1777", "--size", str(size), "--tmpfs", str(dest)]
        self._made.add(dest)

    def filesystem(self, option: str, dest: Path) -> None:
        """--proc or --dev."""
        self.args += [option, str(dest)]
        self._made.add(dest)

    def _parents(self, dest: Path) -> None:
        for folder in reversed(dest.parents):
            if folder in self._made or any(folder.is_relative_to(tree) for tree in self._read_only):
                continue
            self.args += ["--perms", "0755", "--dir", str(folder)]
            self._made.add(folder)


def _system_binds(view: View) -> None:
    for name in SYSTEM_DIRS:
        path = Path("/") / name
        if path.is_symlink():
            view.symlink(os.readlink(path), path)
        elif path.is_dir():
            view.bind(path, path)
    for name in ETC_ENTRIES:
        path = Path("/etc") / name
        if path.exists():
            view.bind(path, path)


def _python_binds(view: View) -> None:
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
    for root in chosen:
        if not root.is_relative_to("/usr"):
            view.bind(root, root)


def _compiler_binds(view: View) -> None:
    """The C compiler Triton builds its GPU launchers with (CC, else gcc, else clang on the PATH, as Triton looks) with
    its installation, where that is outside /usr: a toolchain under /opt, as on some GPU hosts."""
    named = os.environ.get("CC")
    found = shutil.which(named) if named else (shutil.which("gcc") or shutil.which("clang"))
    if found is None:
        return
    prefix = Path(found).resolve().parent.parent  # <prefix>/bin/gcc: the prefix holds its libexec, lib, include
    if not prefix.is_relative_to("/usr") and prefix != Path("/"):
        view.bind(prefix, prefix)


def _gpu_binds(view: View) -> None:
    devices = sorted(Path("/dev").glob("nvidia*"))
    for device in devices:
        view.bind(device, device, "--dev-bind")
    if devices:
        view.bind(Path("/sys"), Path("/sys"))


@dataclass(frozen=True)
class Mounts:
    """What one sandbox sees beyond the system: the student package and, for rank launches, its run folder."""

    impl_dir: Path  # the private copy of the student package, mounted read-only at IMPL_ROOT/<name>
    run_dir: Path | None = None  # writable, mounted at RUN_DIR
    extra_code: tuple[Path, ...] = field(default=())  # further read-only code packages (the grader's own tests)


class Isolation:
    """Builds the command and pre-exec step that put a process (and all it starts) into the sandbox.

    One Isolation is one sandbox at a time (a worker and its restarts, a rank group): fresh() gives another with the
    same settings. A root grader's sandbox holds a uid of its own (grader.sandbox.uids) and, where the machine offers
    one, a control group (grader.sandbox.cgroup), both kept until close()."""

    def __init__(self, level: str, gpu: bool = False, address_space_bytes: int | None = None,
                 disable_userns: bool | None = None, max_processes: int = MAX_PROCESSES,
                 max_memory_bytes: int | None = None):
        if level not in LEVELS:
            raise ValueError(f"unknown isolation level {level!r}; choose one of {', '.join(REQUESTS)}")
        self.level = level
        # No user namespaces inside the sandbox (so no nested sandbox to escape its limits from), where the kernel can
        # say so; the probe finds out. A root grader's sandbox has no user namespace of its own to say it in.
        self.disable_userns = _NESTED_USERNS_CAN_BE_DISABLED[0] if disable_userns is None else disable_userns
        self.gpu = gpu
        self.address_space_bytes = address_space_bytes
        self.max_processes = max_processes
        self.max_memory_bytes = max_memory_bytes or sandbox_memory()
        # Started by root, a sandbox runs as a uid of its own; otherwise its user namespace maps it to the grader's
        # uid, which is not root.
        self.as_root = os.geteuid() == 0 and level != "none"
        self._uid: SandboxUid | None = None
        self._cgroup: ControlGroup | None = None
        self._scratch: Path | None = None

    def fresh(self) -> "Isolation":
        return Isolation(self.level, self.gpu, self.address_space_bytes, self.disable_userns, self.max_processes,
                         self.max_memory_bytes)

    # --- where the student package is seen from inside ------------------------------------------------------------

    def impl_path(self, impl_dir: Path) -> Path:
        return IMPL_ROOT / impl_dir.name if self.level == "bwrap" else impl_dir

    def run_path(self, run_dir: Path) -> Path:
        return RUN_DIR if self.level == "bwrap" else run_dir

    # --- who the sandbox is outside ---------------------------------------------------------------------------------

    def sandbox_uid(self) -> int:
        """The uid student code has outside its sandbox (a root grader's sandbox only)."""
        if self._uid is None:
            self._uid = SandboxUid()
        return self._uid.uid

    def exposes(self, path: Path) -> bool:
        """Whether student code in this sandbox could read `path` (the reference, a key, a seed, a site file)."""
        if self.level == "none":
            return True
        if self.level == "uid":
            return not unreadable_by_sandbox_user(path)
        resolved = path.resolve()
        return any(resolved.is_relative_to(source.resolve()) for source in self._shared_view().sources)

    # --- starting a process ---------------------------------------------------------------------------------------

    def _shared_view(self) -> View:
        """What every sandbox of this grader mounts: the system, the Python (after the private /tmp, so that a Python
        under /tmp is seen), the GPU and the C compiler where it grades on one, and the grader's own code."""
        view = View()
        _system_binds(view)
        view.filesystem("--proc", Path("/proc"))
        view.filesystem("--dev", Path("/dev"))
        view.tmpfs(Path("/dev/shm"), SHM_BYTES)
        view.tmpfs(Path("/tmp"), TMP_BYTES)
        _python_binds(view)
        if self.gpu:
            _gpu_binds(view)
            _compiler_binds(view)
        for package in CODE_PACKAGES:
            view.bind(REPOSITORY / package, CODE_DIR / package)
        return view

    def command(self, argv: list[str], mounts: Mounts) -> list[str]:
        if self.level != "bwrap":
            return argv
        args = [bwrap_path(), "--die-with-parent", "--new-session"]
        if self.as_root:
            # No user namespace: bwrap, as root, sets the sandbox up, and setpriv (inside) becomes the sandbox's uid.
            args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                     "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            args += ["--unshare-all", "--unshare-user", "--cap-drop", "ALL", "--uid", "65534", "--gid", "65534",
                     *(["--disable-userns"] if self.disable_userns else [])]
        view = self._shared_view()
        for name in ("passwd", "group"):
            view.bind(self._accounts() / name, Path("/etc") / name)
        for code in mounts.extra_code:
            view.bind(code, CODE_DIR / code.name)
        view.bind(mounts.impl_dir, IMPL_ROOT / mounts.impl_dir.name)
        if mounts.run_dir is not None:
            view.bind(mounts.run_dir, RUN_DIR, "--bind")
        args += ["--hostname", "sandbox", *view.args,
                 "--chdir", "/tmp", "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp",
                 "--setenv", "USER", SANDBOX_USER, "--setenv", "LOGNAME", SANDBOX_USER,
                 "--setenv", "TRITON_CACHE_DIR", "/tmp/triton", "--setenv", "PYTHONPATH", str(CODE_DIR),
                 "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--"]
        if self.as_root:
            uid = str(self.sandbox_uid())
            return args + [setpriv_path(), "--reuid", uid, "--regid", uid, *DROP_TO_UID, "--"] + argv
        # The process limit set in the sandbox's own user namespace counts that sandbox's processes alone; set on bwrap
        # it would count all of the grader's user's processes, every sandbox's together.
        cap = process_cap(self.max_processes)
        return args + [prlimit_path(), f"--nproc={cap}:{cap}", "--"] + argv

    def _accounts(self) -> Path:
        """The sandbox's /etc/passwd and /etc/group: root and its own user, nothing of the machine's accounts."""
        folder = self.scratch()
        if not (folder / "passwd").exists():
            uid = self.sandbox_uid() if self.as_root else 65534
            (folder / "passwd").write_text(f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
                                           f"{SANDBOX_USER}:x:{uid}:{uid}:student code:/tmp:/usr/sbin/nologin\n")
            (folder / "group").write_text(f"root:x:0:\n{SANDBOX_USER}:x:{uid}:\n")
            for name in ("passwd", "group"):
                (folder / name).chmod(0o644)
        return folder

    def environment(self) -> dict[str, str]:
        env = student_environment()
        if self.level == "uid":
            scratch = str(self.scratch())
            env.update(HOME=scratch, TMPDIR=scratch, TRITON_CACHE_DIR=f"{scratch}/triton", PYTHONDONTWRITEBYTECODE="1")
        return env

    def scratch(self) -> Path:
        """A private folder of this sandbox's: at the `bwrap` level its /etc/passwd and /etc/group, at the `uid` level
        its home, temporary files and Triton cache, so that no two gradings share one; removed by close()."""
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="grader-sandbox-"))
            if self.level == "uid":
                os.chown(self._scratch, self.sandbox_uid(), self.sandbox_uid())
        return self._scratch

    def close(self) -> None:
        """Give back what the sandbox held; its processes must have ended (those left in its group are killed)."""
        if self._cgroup is not None:
            self._cgroup.remove()
            self._cgroup = None
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        if self._uid is not None:
            self._uid.release()
            self._uid = None

    def preexec(self):
        """The function Popen runs in the child before exec: limits, the control group, and for `uid` the switch of
        user."""
        if self.as_root and self._cgroup is None and cgroup.parents() is not None:
            self._cgroup = ControlGroup(self.max_processes, self.max_memory_bytes)
        switch_to = self.sandbox_uid() if self.level == "uid" else None
        # Set on the grader's side of bwrap only where it counts the sandbox's own uid (see command()).
        max_processes = None if self.level == "bwrap" and not self.as_root else self.max_processes
        return functools.partial(_prepare_child, self.address_space_bytes, max_processes, self._cgroup, switch_to)

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
        """Let the sandbox write `path` (a run folder): a root grader's sandbox runs as its own uid."""
        if self.as_root:
            os.chown(path, self.sandbox_uid(), self.sandbox_uid())


def _prepare_child(address_space_bytes: int | None, max_processes: int | None, group: ControlGroup | None,
                   switch_to: int | None) -> None:
    limit_resources(address_space_bytes, max_processes)
    if group is not None:
        group.join()
    if switch_to is not None:
        os.setgroups([])
        os.setgid(switch_to)
        os.setuid(switch_to)


def bwrap_path() -> str:
    return _tool("bwrap", "bubblewrap (bwrap) is not installed: see the README's 'Isolation' section")


def setpriv_path() -> str:
    return _tool("setpriv", "setpriv (util-linux) is not installed: a root grader's sandbox switches uid with it")


def prlimit_path() -> str:
    return _tool("prlimit", "prlimit (util-linux) is not installed: the sandbox's process limit is set with it")


def _tool(name: str, missing: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(missing)
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
        try:
            probe = sandbox.command([sys.executable, "-c", "import torch"], Mounts(impl_dir=REPOSITORY / "grader"))
            completed = subprocess.run(probe, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as error:
            return False, f"bwrap did not start: {error}"
        finally:
            sandbox.close()
        if completed.returncode == 0:
            return True, ""
        if sandbox.as_root:
            break  # no user namespace of its own: nothing to retry without
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
            return "uid", f"no bwrap sandbox ({why}): student code runs as an unprivileged uid of its own"
        return "none", f"no bwrap sandbox ({why}), no uid level ({why_not_uid}): student code runs as the grader's user"
    why_not_uid = uid_unavailable()
    if why_not_uid is not None:
        raise RuntimeError(f"--isolation uid: {why_not_uid}")
    return "uid", "student code runs as an unprivileged uid of its own"


def uid_unavailable() -> str | None:
    """Why student code cannot run as an unprivileged uid here; None if it can."""
    if os.geteuid() != 0:
        return "switching to an unprivileged user needs the grader to run as root"
    if unreadable_by_sandbox_user(Path(sys.executable), execute=True):
        return f"an unprivileged user cannot run this Python ({sys.executable})"
    return None


def unreadable_by_sandbox_user(path: Path, execute: bool = False) -> bool:
    """Whether the `uid` level's user is kept out of `path` (from reading it, or running it) by a directory on the way
    or the file itself. Owner and group bits are not considered: the sandbox's uid owns nothing and is in no group."""
    for part in [*reversed(path.resolve().parents), path.resolve()]:
        try:
            mode = part.stat().st_mode
        except OSError:
            return True
        needed = 0o001 if part.is_dir() or execute else 0o004
        if not mode & needed:
            return True
    return False
