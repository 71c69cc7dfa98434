"""The pytest plugin behind `pytest grader`: options, fixtures, statuses, the score table and the results file."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import hypothesis
import pytest
import torch

from assignment import registry
from assignment.registry import Problem, problem_for_test_module
from grader import expectations
from grader.checks import answers, marks, profiles, stubs
from grader.checks.inert import inert
from grader.checks.outcomes import NotImplementedByStudent, RuleViolation
from grader.cluster import site
from grader.cluster.snapshot import BadSubmission, snapshot
from grader.ranks.launcher import RankJob, launch, launcher_for
from grader.sandbox import isolation, policy, source_policy
from grader.sandbox.client import Sandbox
from grader.session import backend, budget, dump, lanes, outer_timeout, reference_lock, seal
from grader.session.context import Context, current, secret_seed, set_current, take_secret_seed
from grader.session.items import problem_of
from grader.session.outer_timeout import pytest_timeout_set_timer  # pytest-timeout's hook, owned here
from grader.session.packages import PackageSpec, load_problem_module, resolve
from grader.session.progress import Progress
from grader.session.report import failure_summary, isolation_line, results_json, score_table, shown
from grader.session.scoring import TestResult, by_problem, classify

RESULTS = pytest.StashKey[dict]()
# A test that earns part of its points (speed tiers) says so through the `partial_credit` fixture.
PARTIAL = pytest.StashKey[tuple[float, str]]()
GROUP_SIZES = pytest.StashKey[dict]()
STARTED = pytest.StashKey[float]()
REFERENCE_HASHES = pytest.StashKey[dict]()
REFERENCE_MODULES = pytest.StashKey[dict]()
RESULTS_KEY = pytest.StashKey[object]()
PROGRESS = pytest.StashKey[Progress]()
ALL_STUBS = pytest.StashKey[dict]()
# Per problem: what the source policy found in the graded package (grader.sandbox.source_policy), read once.
SOURCE_VIOLATIONS = pytest.StashKey[dict]()
# Per problem: when its first test started and its last one ended (wall clock, for the results file).
PROBLEM_SPAN = pytest.StashKey[dict]()
EXPECTATIONS = pytest.StashKey[expectations.Store | None]()
# --dump-failing's folder, and the problems whose failing call this process saved there.
DUMP_FOLDER = pytest.StashKey[Path]()
DUMPED = pytest.StashKey[set]()
# Per problem collected on a machine without a GPU: the dtypes its tests draw on a GPU only (grader.checks.marks).
GPU_ONLY_DTYPES = pytest.StashKey[dict]()
# The node ids graded in other processes (lanes of --jobs, the students' copy's GPU lane): pytest printed none of
# their failures here.
GRADED_ELSEWHERE = pytest.StashKey[set]()

__all__ = [
    "pytest_addoption",
    "pytest_configure",
    "pytest_itemcollected",
    "pytest_collection_modifyitems",
    "pytest_collection_finish",
    "pytest_runtestloop",
    "pytest_report_teststatus",
    "pytest_timeout_set_timer",
    "pytest_runtest_setup",
    "pytest_runtest_setup_expectations",
    "pytest_runtest_makereport",
    "pytest_terminal_summary",
    "pytest_sessionfinish",
    "problem",
    "reference",
    "student",
    "sheet",
    "student_of",
    "ranks",
    "ranks_of",
    "student_budget",
    "partial_credit",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("grader")
    group.addoption("--problem", action="append", default=[],
                    help="grade only this problem, e.g. --problem moe.router (repeat it, or separate ids by commas, "
                         "for several)")
    group.addoption("--details", action="store_true",
                    help="print every failure in full (by default: the first failure of each problem in full, one "
                         "line for each other; -v does the same as --details)")
    group.addoption("--impl", default=os.environ.get("GRADER_IMPL", "student_impl"),
                    help="implementation to grade: a directory or an importable package (env GRADER_IMPL)")
    group.addoption("--reference", default=os.environ.get("GRADER_REFERENCE", "reference"),
                    help="reference to compare against: a directory or an importable package (env GRADER_REFERENCE)")
    group.addoption("--expectations", default=os.environ.get("GRADER_EXPECTATIONS"),
                    help="grade from the expectations stored in this folder instead of running the reference (the "
                         "students' copy does so by default; env GRADER_EXPECTATIONS)")
    group.addoption("--record-expectations", default=None,
                    help="store what the tests take from the reference in this folder (run by `python -m grader "
                         "release`)")
    group.addoption("--profile", default=os.environ.get("GRADER_PROFILE", "public"),
                    help="public (default), grading (needs GRADER_SECRET_SEED) or ci (env GRADER_PROFILE)")
    group.addoption("--launcher", default=os.environ.get("GRADER_LAUNCHER", "local"),
                    help="how distributed problems start their ranks: local (default), submitit, or srun inside a "
                         "Slurm allocation (env GRADER_LAUNCHER)")
    group.addoption("--timeout-scale", type=float, default=float(os.environ.get("GRADER_TIMEOUT_SCALE", "1")),
                    help="multiply every time limit by this factor, e.g. 2 on a slow machine "
                         "(env GRADER_TIMEOUT_SCALE)")
    group.addoption("--world-sizes", default=os.environ.get("GRADER_WORLD_SIZES"),
                    help="comma-separated numbers of ranks for every distributed problem's main tests, replacing the "
                         "registry's, e.g. 4,8 on an 8-GPU node (env GRADER_WORLD_SIZES)")
    group.addoption("--results-json", default=os.environ.get("GRADER_RESULTS_JSON"),
                    help="write Gradescope's results.json here (env GRADER_RESULTS_JSON)")
    group.addoption("--isolation", default=os.environ.get(isolation.ISOLATION_VARIABLE, "auto"),
                    choices=isolation.REQUESTS,
                    help="sandbox for student code: auto (bwrap when it works here, else uid as root, else none), "
                         "bwrap, uid or none (env GRADER_ISOLATION)")
    group.addoption("--refuse-unisolated", action="store_true",
                    help="stop with a usage error where no sandbox (bwrap or uid) can be had: cluster grading jobs")
    group.addoption("--allow-unisolated", action="store_true",
                    help="grade the grading profile even where no sandbox (bwrap or uid) can be had, which lets "
                         "student code read the reference and forge results (refused without this)")
    group.addoption("--jobs", type=int, default=int(os.environ.get("GRADER_JOBS", "1")),
                    help="grade the selected problems in this many concurrent processes, whole problems each (e.g. "
                         "4 on a GPU host with 16 cores; default 1: one after another; env GRADER_JOBS)")
    group.addoption("--gpu-lane", default="auto", choices=("auto", "on", "off"),
                    help="in the students' copy, which grades on the CPU: run the speed tests afterwards in a process "
                         "that sees the GPUs (auto: where this machine has NVIDIA GPUs; off: leave them skipped)")
    group.addoption("--lane-record", default=None,
                    help="(set by --jobs for the processes it starts: the file their results go to)")
    group.addoption("--source-policy", default=os.environ.get("GRADER_SOURCE_POLICY", "on"), choices=("on", "off"),
                    help="check each problem's source against its family's rules before any of it runs (on, the "
                         "default); off only tests the runtime guards behind the policy, and the grading profile "
                         "refuses it (env GRADER_SOURCE_POLICY)")
    group.addoption("--dump-failing", default=None, metavar="DIR",
                    help="for each problem's first failing test that called your function, save that call's inputs "
                         "in DIR (torch.save) with a three-line Python file that calls your function on them again: "
                         "DIR/<problem>__<test>.pt and .py")
    group.addoption("--results-nonce", default="",
                    help="a grading job's nonce, signed into the results with the key in GRADER_RESULTS_KEY_FILE")


def pytest_configure(config: pytest.Config) -> None:
    for name, meaning in marks.MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")
    refusal = backend.interpreter_refusal()
    if refusal is not None:
        raise pytest.UsageError(refusal)
    # The grader's own tensors are small, and an idle torch CPU thread spins for a while after each parallel region:
    # graders side by side (lanes, or a worker beside its grader) took each other's cores. Four concurrent gradings of
    # moe.router on a 16-core H200 host took 152 s each with torch's sixteen threads a process, 28 s with one.
    torch.set_num_threads(1)
    profile = config.getoption("--profile")
    profiles.load(profile)
    secret_files = secret_paths()  # before the key and the seed leave the environment
    config.stash[RESULTS_KEY] = seal.take_key()
    if profile == "grading" and config.getoption("--source-policy") == "off":
        raise pytest.UsageError("--source-policy off only tests the runtime guards behind the source policy: the "
                                "grading profile always checks it")
    if profile == "grading":
        try:
            take_secret_seed()  # fail now, before any test, if the seed is missing
        except (OSError, RuntimeError, ValueError) as error:
            raise pytest.UsageError(str(error)) from None
    for variable in policy.SECRET_VARIABLES:
        os.environ.pop(variable, None)  # nothing started from here on inherits a secret
    world_sizes = None
    if config.getoption("--world-sizes"):
        text = config.getoption("--world-sizes")
        try:
            world_sizes = tuple(int(n) for n in text.split(","))
        except ValueError:
            raise pytest.UsageError(f"--world-sizes takes numbers such as 4,8, not {text!r}") from None
        if not world_sizes or min(world_sizes) < 1:
            raise pytest.UsageError("--world-sizes needs at least one number of ranks, each >= 1")
    root = Path(config.rootpath)
    search_path = [str(Path.cwd()), str(root)]
    try:
        impl = resolve(config.getoption("--impl"), search_path)
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    config.stash[EXPECTATIONS] = store = expectations_store(config, profile)
    if store is not None and store.mode == "replay":
        profiles.without_shrinking()
    try:
        reference = resolve(config.getoption("--reference"), search_path)
    except ValueError as error:
        if store is None or store.mode != "replay":
            raise pytest.UsageError(str(error)) from None
        reference = PackageSpec("reference", root / "reference")  # absent: nothing to import, nothing to hide
    try:
        level, note = isolation.choose(config.getoption("--isolation"))
    except (RuntimeError, ValueError) as error:
        raise pytest.UsageError(str(error)) from None
    unisolated_refused = config.getoption("--refuse-unisolated") or (
        profile == "grading" and not config.getoption("--allow-unisolated"))
    if level == "none" and unisolated_refused:
        raise pytest.UsageError(f"refusing to grade without a sandbox: {note}" + (
            "; --allow-unisolated grades the grading profile all the same" if profile == "grading" else ""))
    device = backend.device()
    on_gpu = device.type == "cuda"
    memory_cap = None if on_gpu else isolation.physical_memory()
    sandbox = isolation.Isolation(level, gpu=on_gpu, address_space_bytes=memory_cap)
    if reference.path.exists():
        secret_files["the reference"] = reference.path
    exposed = [f"{what} ({path})" for what, path in secret_files.items() if level != "none" and sandbox.exposes(path)]
    if exposed:
        remedy = ("make a directory on its path private (chmod o-rx)" if level == "uid" else
                  "keep it out of the system folders and the Python's (see the README's Isolation section)")
        raise pytest.UsageError(f"--isolation {level}: student code could read {', '.join(exposed)}; {remedy}")
    set_current(Context(impl=impl, reference=reference, device=device, isolation=sandbox,
                        isolation_note=note, impl_copy=private_copy(impl, sandbox), world_sizes=world_sizes))
    config.stash[RESULTS] = {}
    config.stash[ALL_STUBS] = {}
    config.stash[SOURCE_VIOLATIONS] = {}
    config.stash[PROBLEM_SPAN] = {}
    config.stash[GROUP_SIZES] = {}
    config.stash[STARTED] = time.monotonic()
    if config.getoption("--dump-failing"):
        config.stash[DUMP_FOLDER] = dump_folder(Path(config.getoption("--dump-failing")))
        config.stash[DUMPED] = set()
    if not shows_every_failure(config):
        # pytest's own failure sections go: the summary prints one line per failure and the first of each problem in
        # full (see grader.session.report.failure_summary).
        config.option.tbstyle = "no"
        config.option.reportchars = config.option.reportchars.replace("f", "").replace("F", "")


def dump_folder(given: Path) -> Path:
    folder = given.resolve()
    if folder.exists() and not folder.is_dir():
        raise pytest.UsageError(f"--dump-failing {given}: not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def secret_paths() -> dict[str, Path]:
    """The files no student process may read, by what they are: the results key, the grading seed, the cluster's site
    file (which names the reference and the seed)."""
    named = {"the results key": os.environ.get(policy.RESULTS_KEY_FILE_VARIABLE),
             "the grading seed": os.environ.get(policy.SECRET_SEED_FILE_VARIABLE),
             "the site file": str(site.site_file())}
    return {what: Path(path) for what, path in named.items() if path and Path(path).exists()}


def expectations_store(config: pytest.Config, profile: str) -> expectations.Store | None:
    """Where the reference's values come from: recorded into a folder, replayed from one (given, or the students'
    copy's own), or (None) the reference itself."""
    recording = config.getoption("--record-expectations")
    if recording:
        return expectations.Store(Path(recording) / profile, "record", profile)
    given = config.getoption("--expectations")
    folder = Path(given) if given else expectations.students_copy_folder()
    if folder is None:
        return None
    if not (folder / profile).is_dir():
        held = sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
        raise pytest.UsageError(f"no stored expectations for the {profile} profile in {folder} (it holds: "
                                f"{', '.join(held) or 'none'}); the {profile} profile is graded on submission")
    try:
        if not expectations.in_gpu_lane():  # which grades speed alone: no stored draws
            expectations.check_draws(folder / profile)
    except expectations.DrawsDiffer as error:
        raise pytest.UsageError(error.message) from None
    return expectations.Store(folder / profile, "replay", profile)


def shows_every_failure(config: pytest.Config) -> bool:
    return config.getoption("--details") or config.getoption("verbose") > 0


def selected_problems(config: pytest.Config) -> set[str] | None:
    """The ids given with --problem (None: no --problem, every collected problem is graded)."""
    try:
        given = registry.problem_ids(",".join(config.getoption("--problem")))
    except ValueError as error:
        raise pytest.UsageError(f"--problem: {error}") from None
    return set(given) if given else None


def private_copy(impl: PackageSpec, sandbox: isolation.Isolation) -> PackageSpec | None:
    """The package the sandboxes see: a copy taken now, so that nothing changes it while it is graded (under bwrap
    it is also mounted read-only); removed when the session ends. A package holding anything but regular files and
    folders (a link to the reference, say) is not graded at all."""
    folder = Path(tempfile.mkdtemp(prefix="grader-impl-"))
    try:
        copy = snapshot(impl.path, folder / impl.name)
    except BadSubmission as error:
        shutil.rmtree(folder)
        raise pytest.UsageError(f"not graded: {error}") from None
    if sandbox.level == "uid":
        folder.chmod(0o755)  # the copy itself is world-readable; the sandbox's user must get through to it
    return PackageSpec(impl.name, copy)


def pytest_itemcollected(item: pytest.Item) -> None:
    problem = problem_of(item)
    if problem is None:
        return
    group = marks.group_of(item)
    if group not in problem.points:
        raise pytest.UsageError(f"{item.nodeid}: test group {group!r} has no points in the registry for {problem.id}")
    sizes = item.config.stash[GROUP_SIZES]
    sizes[(problem.id, group)] = sizes.get((problem.id, group), 0) + 1
    outer_timeout.mark(item, problem.test_timeout_s * item.config.getoption("--timeout-scale"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = selected_problems(config)
    if wanted is not None:
        deselected = [item for item in items if problem_of(item) is None or problem_of(item).id not in wanted]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if item not in deselected]
    # Problems in the registry's (teaching) order, which the score table follows; a problem's tests keep theirs.
    teaching_order = {problem.id: index for index, problem in enumerate(registry.PROBLEMS)}
    items.sort(key=lambda item: teaching_order.get(getattr(problem_of(item), "id", None), len(teaching_order)))
    lock_reference(config, items)
    if current().device.type != "cuda":
        test_modules = {problem_of(item).id: item.module for item in items if problem_of(item)}
        config.stash[GPU_ONLY_DTYPES] = {problem_id: marks.dtypes_drawn_on_gpu_only(module)
                                         for problem_id, module in test_modules.items()}
    if current().profile != "grading":
        return
    seed = secret_seed()
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and hasattr(function, "hypothesis"):
            hypothesis.seed(seed ^ zlib.crc32(item.nodeid.split("[")[0].encode()))(function)


def lock_reference(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Import the reference modules of the selected problems and hash the reference's files, before any student code
    starts (see grader.session.reference_lock)."""
    reference = current().reference
    config.stash[REFERENCE_HASHES] = reference_lock.fingerprint(reference.path)
    modules = {}
    for problem_id in {problem.id for problem in map(problem_of, items) if problem is not None}:
        if reference.module_file(problem_id).exists():
            modules[problem_id] = load_problem_module(reference, problem_id)
    config.stash[REFERENCE_MODULES] = modules


# --- fixtures -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def problem(request: pytest.FixtureRequest) -> Problem:
    found = problem_for_test_module(request.module.__name__)
    assert found is not None, f"{request.module.__name__} is not the test module of a registered problem"
    return found


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest, problem: Problem):
    """The reference module, imported in the grader's own process before any student code ran (student code never
    is)."""
    store = request.config.stash[EXPECTATIONS]
    if store is not None and store.mode == "replay":
        return budget.ReplayedReference(problem.id)
    modules = request.config.stash[REFERENCE_MODULES]
    module = modules[problem.id] if problem.id in modules else load_problem_module(current().reference, problem.id)
    return budget.TimedReference(module, problem.id, recording=store is not None)


def sandbox_for(config: pytest.Config, problem: Problem) -> Sandbox:
    """The student's module of `problem`, behind a worker process under that problem's rules."""
    context = current()
    kind = dump.RecordingSandbox if DUMP_FOLDER in config.stash else Sandbox
    return kind(
        problem.id,
        context.graded,
        context.reference,
        isolation=context.isolation,
        call_timeout_s=problem.call_timeout_s * config.getoption("--timeout-scale"),
        forbidden_ops=problem.forbidden_ops,
        uses_triton=problem.uses_triton,
        forbid_torch_data_parallel=problem.family == "parallel",
        stubs=stubs.stub_functions(context.graded.module_file(problem.id)),
    )


@pytest.fixture(scope="module")
def student(request: pytest.FixtureRequest, problem: Problem):
    """The student's module, behind a worker process. See grader.sandbox.client.Sandbox."""
    sandbox = sandbox_for(request.config, problem)
    yield sandbox
    sandbox.close()


@pytest.fixture(scope="module")
def sheet(problem: Problem) -> dict:
    """An analysis problem's answers, read from the student's sheet without running it (grader.checks.answers)."""
    return answers.read_sheet(current().graded.module_file(problem.id))


def measured_problem(config: pytest.Config, problem_id: str) -> Problem:
    """Another problem, one that an analysis question measures; "not implemented" while its module is the stub, and
    a rule violation while its source breaks the source policy."""
    module_file = current().graded.module_file(problem_id)
    if not module_file.exists() or stubs.all_stubs(module_file):
        raise NotImplementedByStudent(f"{problem_id} is not implemented, and this question measures it")
    found = source_violations(config, problem_id)
    if found:
        raise RuleViolation(f"{problem_id}, which this question measures, breaks the source policy:\n"
                            f"{violations_text(found)}")
    return registry.BY_ID[problem_id]


def source_violations(config: pytest.Config, problem_id: str) -> list[source_policy.Violation]:
    """The source policy's violations in what importing the problem's module runs, read once per problem (none with
    --source-policy off)."""
    if config.getoption("--source-policy") == "off":
        return []
    known = config.stash[SOURCE_VIOLATIONS]
    if problem_id not in known:
        graded = current().graded
        known[problem_id] = source_policy.violations(graded.name, graded.path, problem_id)
    return known[problem_id]


def violations_text(found: list[source_policy.Violation], shown_at_most: int = 5) -> str:
    """One line per violation, the first few of them (the names in them come from the student's files)."""
    lines = [str(violation) for violation in found[:shown_at_most]]
    if len(found) > shown_at_most:
        lines.append(f"... and {len(found) - shown_at_most} more")
    return inert("\n".join(lines))


@pytest.fixture
def student_of(request: pytest.FixtureRequest):
    """Opens the student's module of another problem, one that an analysis question measures: call with its id. It
    runs under that problem's rules and this test's budget, and is closed when the test ends."""
    opened = []

    def open_module(problem_id: str) -> Sandbox:
        sandbox = sandbox_for(request.config, measured_problem(request.config, problem_id))
        sandbox.begin_test(budget.active())
        opened.append(sandbox)
        return sandbox

    yield open_module
    for sandbox in opened:
        sandbox.close()


class Ranks:
    """Runs a program of the test module on several ranks, each importing the student's module."""

    def __init__(self, problem: Problem, launcher, timeout_scale: float, store: expectations.Store | None):
        self.problem = problem
        self.launcher = launcher
        self.timeout_scale = timeout_scale
        self.store = store

    def run(self, program, world_size: int, *args, rank_data: list | None = None, **kwargs) -> list:
        """Each rank's return value of program(student_module, rank, world_size, *args, **kwargs); with rank_data,
        rank r alone also receives rank_data=rank_data[r]: inputs that the other ranks never see."""
        return self._launch(current().graded, program, world_size, args, kwargs, rank_data)

    def run_reference(self, program, world_size: int, *args, rank_data: list | None = None, **kwargs) -> list:
        """The same program with the reference in place of the student (for ratios measured in one run, and
        references too costly for the grader's process). Recorded and replayed as a reference function's call is."""
        name = f"launch {program.__name__}"
        inputs = (world_size, args, kwargs, rank_data)
        if self.store is not None and self.store.mode == "replay":
            results, seconds = expectations.replay(name, inputs, {}, current().device)
        elif self.store is not None:
            results, seconds = expectations.record(
                name, lambda *_: self._launch(current().reference, program, world_size, args, kwargs, rank_data),
                inputs, {})
        else:
            started = time.monotonic()
            results = self._launch(current().reference, program, world_size, args, kwargs, rank_data)
            seconds = time.monotonic() - started
        budget.count_reference_time(name, seconds)
        return results

    def _launch(self, impl, program, world_size: int, args: tuple, kwargs: dict, rank_data: list | None) -> list:
        context = current()
        job = RankJob(
            problem=self.problem.id,
            impl=impl,
            reference=context.reference,
            program=f"{program.__module__}:{program.__name__}",
            world_size=world_size,
            args=args,
            kwargs=kwargs,
            rank_data=rank_data,
            isolation=context.isolation.level,
            disable_userns=context.isolation.disable_userns,
            timeout_s=self.problem.call_timeout_s * self.timeout_scale,
            # The launcher's own deadline ends a hang first, with a diagnosis; the collective timeout only guarantees
            # that ranks nobody watches (a Slurm job) cannot wait forever.
            collective_timeout_s=self.problem.call_timeout_s * self.timeout_scale + 30,
        )
        return launch(self.launcher, job)

    def close(self) -> None:
        if hasattr(self.launcher, "close"):
            self.launcher.close()


def ranks_for(config: pytest.Config, problem: Problem) -> Ranks:
    """Ranks running the student's module of `problem`, through a launcher of the run's --launcher."""
    return Ranks(problem, launcher_for(config.getoption("--launcher")), config.getoption("--timeout-scale"),
                 config.stash[EXPECTATIONS])


@pytest.fixture(scope="module")
def ranks(request: pytest.FixtureRequest, problem: Problem):
    """The problem's launcher, kept for its tests (the local one keeps its rank groups) and closed after them."""
    opened = ranks_for(request.config, problem)
    yield opened
    opened.close()


@pytest.fixture
def ranks_of(request: pytest.FixtureRequest):
    """Ranks running the student's module of another problem, one that an analysis question measures: call with its
    id. They run under that problem's rules; the launcher is closed when the test ends."""
    opened = []

    def open_ranks(problem_id: str) -> Ranks:
        opened.append(ranks_for(request.config, measured_problem(request.config, problem_id)))
        return opened[-1]

    yield open_ranks
    for ranks_of_problem in opened:
        ranks_of_problem.close()


@pytest.fixture
def partial_credit(request: pytest.FixtureRequest):
    """Call with (fraction of the test's points earned, why) before the test ends."""

    def award(fraction: float, why: str) -> None:
        request.node.stash[PARTIAL] = (fraction, why)

    return award


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A problem whose module file is missing, or all stubs, is "not implemented", and a test that would run a module
    whose source breaks the source policy (grader.sandbox.source_policy) fails, before any of its fixtures is set up.

    Raised from this hook, not from a fixture: pytest 9.1 leaves a function fixture that raised in a state that fails
    the next test using it, which would cost another problem its points."""
    problem = problem_of(item)
    if problem is None:
        return
    if problem.id not in item.config.stash[PROBLEM_SPAN]:
        item.config.stash[PROBLEM_SPAN][problem.id] = [time.monotonic(), time.monotonic()]
        record_for_parent(item.config, ("started", problem.id))
    if PROGRESS in item.config.stash:
        item.config.stash[PROGRESS].test_started(problem.id)
    module_file = current().impl.module_file(problem.id)
    if not module_file.exists():
        raise NotImplementedByStudent(f"not implemented ({module_file} does not exist)")
    known = item.config.stash[ALL_STUBS]
    if problem.id not in known:
        known[problem.id] = stubs.all_stubs(current().graded.module_file(problem.id))
    if known[problem.id]:
        raise NotImplementedByStudent("not implemented")  # every function is still the stub: no worker, no ranks
    found = source_violations(item.config, problem.id) if runs_student_code(item) else []
    if found:
        raise RuleViolation(violations_text(found))  # before the worker starts or the ranks launch


@pytest.hookimpl(specname="pytest_runtest_setup")
def pytest_runtest_setup_expectations(item: pytest.Item) -> None:
    """Read the problem's stored expectations before its fixtures are set up, so that a problem they lack is "not
    graded" in every one of its tests (raised from a fixture, pytest 9.1 and later fail its next tests with an
    AssertionError). Not tryfirst, unlike pytest_runtest_setup: a test skipped on this machine stays skipped."""
    problem = problem_of(item)
    store = item.config.stash[EXPECTATIONS]
    if problem is not None and store is not None and store.mode == "replay":
        store.problem(problem.id)


def runs_student_code(item: pytest.Item) -> bool:
    """Whether the test runs the problem's module (an analysis question's answer sheet is read as data instead)."""
    return not {"student", "ranks"}.isdisjoint(getattr(item, "fixturenames", ()))


@pytest.fixture(autouse=True)
def student_budget(request: pytest.FixtureRequest) -> None:
    problem = problem_of(request.node)
    if problem is None:
        return
    test_budget = budget.begin(problem.test_timeout_s * request.config.getoption("--timeout-scale"))
    store = request.config.stash[EXPECTATIONS]
    if store is not None:
        store.begin_test(problem.id, request.node.nodeid)
    if "student" in request.fixturenames:
        request.getfixturevalue("student").begin_test(test_budget)


# --- outcomes -------------------------------------------------------------------------------------------------------


def reproduce_hint(item: pytest.Item) -> str:
    """The command that reruns this one test (its node id: file and test, with its parameters)."""
    context = current()
    seed = " with the same GRADER_SECRET_SEED" if context.profile == "grading" else ""
    impl = context.impl.path
    default = Path(item.config.rootpath) / "student_impl"
    with_impl = "" if impl == default else f" --impl {shlex.quote(shown_path(impl))}"
    return f"reproduce: pytest {shlex.quote(item.nodeid)}{with_impl} --profile {context.profile}{seed}"


def shown_path(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# Hypothesis names a failing test's arguments; the fixtures among them are the grader's handles, not inputs.
FIXTURE_ARGUMENT = re.compile(r"^\s+(student|reference|ranks|problem|partial_credit)=.*,$")


def without_fixture_arguments(notes: list[str]) -> str:
    return "\n".join(line for note in notes for line in note.splitlines() if not FIXTURE_ARGUMENT.match(line))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    problem = problem_of(item)
    if problem is not None and problem.id in item.config.stash[PROBLEM_SPAN]:
        item.config.stash[PROBLEM_SPAN][problem.id][1] = time.monotonic()
    if problem is None or (report.when != "call" and report.passed) or report.when == "teardown":
        return
    group = marks.group_of(item)
    result = TestResult(item.nodeid, problem, group, test_share(item.config, problem, group),
                        duration_s=report.duration)
    if report.passed and PARTIAL in item.stash:
        result.fraction, result.message = item.stash[PARTIAL]
    store = item.config.stash[EXPECTATIONS]
    if report.passed and store is not None and store.mode == "replay" and expectations.misses_in_test():
        # Passing is only a verdict if every drawn input was a recorded one.
        report.outcome = "failed"
        result.status, result.message = expectations.DrawsDiffer.status, (
            f"{expectations.misses_in_test()} drawn inputs had no stored expectation: this machine draws other "
            "inputs than those recorded for the students' copy")
        report.longrepr = result.detail = f"[{result.status}] {result.message}"
    if report.skipped:
        result.status = "skipped"
        result.message = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        result.message = result.message.removeprefix("Skipped: ")
    elif report.failed and call.excinfo is not None:
        error = call.excinfo.value
        result.status, result.message = classify(error)
        notes = without_fixture_arguments(getattr(error, "__notes__", []))
        if result.status == "not implemented":
            report.longrepr = result.message
        else:
            report.longrepr = result.detail = "\n".join(
                part for part in (f"[{result.status}] {result.message}", notes, reproduce_hint(item),
                                  dumped_call(item, problem, result.status)) if part
            )
    item.config.stash[RESULTS][item.nodeid] = result
    record_for_parent(item.config, ("result", result, item.config.stash[PROBLEM_SPAN][problem.id]))
    if PROGRESS in item.config.stash:
        item.config.stash[PROGRESS].test_finished(problem.id, result.status)


def dumped_call(item: pytest.Item, problem: Problem, status: str) -> str:
    """With --dump-failing, at the problem's first failing test that called the student's function (in this process):
    save that call (grader.session.dump) and say how to run it; "" otherwise."""
    config = item.config
    sandbox = getattr(item, "funcargs", {}).get("student")
    if (DUMP_FOLDER not in config.stash or problem.id in config.stash[DUMPED] or expectations.in_gpu_lane()
            or status == expectations.DrawsDiffer.status or not isinstance(sandbox, dump.RecordingSandbox)
            or sandbox.last_call is None):
        return ""
    config.stash[DUMPED].add(problem.id)
    context = current()
    path = dump.dump(config.stash[DUMP_FOLDER], context.impl, problem.id, item.name, sandbox.last_call,
                     interpreted=context.device.type != "cuda")
    return f"inputs saved: python {shlex.quote(shown_path(path))} calls your function on them again"


def sandbox_warning() -> str:
    """A grading whose student code runs without the bwrap sandbox says so first, on the terminal and in the results,
    not only in the score table's last line ("" when it ran in the sandbox)."""
    context = current()
    if context.isolation.level == "bwrap":
        return ""
    return f"WARNING: {isolation_line(context.isolation.level, context.isolation_note)}"


def warn_if_unsandboxed(config: pytest.Config) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if sandbox_warning() and reporter is not None and not config.getoption("--lane-record"):
        reporter.write_line(sandbox_warning(), yellow=True, bold=True)


def record_for_parent(config: pytest.Config, record: tuple) -> None:
    """In a lane of --jobs: pass the record to the process that started the lane (see grader.session.lanes)."""
    path = config.getoption("--lane-record")
    if path:
        lanes.append_record(Path(path), record)


def pytest_collection_finish(session: pytest.Session) -> None:
    warn_if_unsandboxed(session.config)
    totals: dict[str, int] = {}
    for item in session.items:
        problem = problem_of(item)
        if problem is not None:
            totals[problem.id] = totals.get(problem.id, 0) + 1
    if totals and session.config.getoption("verbose") <= 0:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        session.config.stash[PROGRESS] = Progress(reporter, totals)
        if reporter is not None:
            reporter.showfspath = False  # the progress line names the problem
        session.config.option.console_output_style = "classic"  # no percentages: the progress lines count


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session: pytest.Session):
    """Where the tests run. With --jobs N and more than one problem selected, in N lanes (grader.session.lanes), not
    here. In the students' copy, which grades on the CPU, the speed tests wait for the GPU lane, which runs them after
    the others with the GPUs visible (grader.expectations.students_copy), with the tests marked timed_on_gpu."""
    every_item = list(session.items)
    speed_items = [item for item in every_item
                   if marks.group_of(item) == "speed" or item.get_closest_marker("timed_on_gpu")
                   ] if wants_gpu_lane(session) else []
    session.items[:] = [item for item in every_item if item not in speed_items]
    try:
        if graded_in_lanes(session):
            session.items[:] = []  # pytest's own loop has nothing left to run
        outcome = yield
    finally:
        session.items[:] = every_item
    if speed_items:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"speed: {len(speed_items)} tests, now run in a second process that sees the GPUs "
                                "(the students' copy grades the rest on the CPU)")
        run_lanes_and_take_records(session, [[item.nodeid for item in speed_items]],
                                   expectations.gpu_lane_environment())
    if GRADED_ELSEWHERE in session.config.stash:
        in_collection_order(session)
    return outcome


def graded_in_lanes(session: pytest.Session) -> bool:
    """Grade session.items in lanes if --jobs asks for it and more than one problem is selected."""
    config = session.config
    problem_ids = {getattr(problem_of(item), "id", None) for item in session.items}
    if (config.getoption("--jobs") <= 1 or config.getoption("--lane-record") or config.option.collectonly
            or None in problem_ids or len(problem_ids) < 2):
        return False
    context = current()
    seed = secret_seed() if context.profile == "grading" else None
    times_key = f"{context.profile}/{context.device.type}"
    dealt = lanes.deal_items(session, config.getoption("--jobs"), lanes.known_seconds(times_key))
    run_lanes_and_take_records(session, dealt, lanes.lane_environment(context.profile, seed))
    lanes.remember_seconds(times_key, {problem_id: end - start
                                       for problem_id, (start, end) in config.stash[PROBLEM_SPAN].items()})
    return True


def run_lanes_and_take_records(session: pytest.Session, nodeids_by_lane: list[list[str]],
                               environment: dict[str, str]) -> None:
    """Run the lanes, taking each record as it arrives; a test a lane left without a result is a grader error."""
    config = session.config
    unrecorded = lanes.run_lanes(config, nodeids_by_lane, current().impl.path, environment,
                                 lambda record: take_lane_record(config, record))
    for log_tail, nodeids in unrecorded.items():
        for item in (item for item in session.items if item.nodeid in nodeids):
            result = lanes.lost_result(item.nodeid, problem_of(item), marks.group_of(item), log_tail)
            take_lane_record(config, ("result", result, None))


def in_collection_order(session: pytest.Session) -> None:
    """Order the results as one process lists them, and count the failures of those graded elsewhere too."""
    config = session.config
    results = config.stash[RESULTS]
    config.stash[RESULTS] = {item.nodeid: results[item.nodeid] for item in session.items if item.nodeid in results}
    session.testsfailed = sum(result.status not in ("passed", "skipped") for result in config.stash[RESULTS].values())


def wants_gpu_lane(session: pytest.Session) -> bool:
    config = session.config
    store = config.stash[EXPECTATIONS]
    if (store is None or store.mode != "replay" or config.getoption("--lane-record") or config.option.collectonly
            or expectations.in_gpu_lane()):
        return False
    choice = config.getoption("--gpu-lane")
    return choice == "on" or (choice == "auto" and expectations.hidden_gpus_present())


def test_share(config: pytest.Config, problem: Problem, group: str) -> float:
    """The points one test of `group` is worth: the group's points over the number of its tests collected here."""
    return problem.points[group] / config.stash[GROUP_SIZES][(problem.id, group)]


def take_lane_record(config: pytest.Config, record: tuple) -> None:
    """In the process that started lanes: one record of a lane (a problem started, or a test's result and its
    problem's span)."""
    progress = config.stash.get(PROGRESS, None)
    if record[0] == "started":
        if progress is not None:
            progress.test_started(record[1])
        return
    _, result, span = record
    # The lane collected only the selected tests; the share counts the tests of the group collected here.
    result.share = test_share(config, result.problem, result.group)
    config.stash[RESULTS][result.nodeid] = result
    config.stash.setdefault(GRADED_ELSEWHERE, set()).add(result.nodeid)
    if span is not None:  # the problem's first start and last end, over every process that graded some of it
        known = config.stash[PROBLEM_SPAN].get(result.problem.id, span)
        config.stash[PROBLEM_SPAN][result.problem.id] = [min(known[0], span[0]), max(known[1], span[1])]
    if progress is not None:
        progress.test_finished(result.problem.id, result.status)


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
    """A stub's failure is filed as "not implemented", not "failed", so pytest prints no failure section for it; and
    while the progress lines count graded tests, pytest prints no letter per test."""
    result = config.stash.get(RESULTS, {}).get(report.nodeid)
    if result is None or not (report.when == "call" or report.failed or report.skipped):
        return None
    quiet = PROGRESS in config.stash
    if report.failed and result.status == "not implemented":
        return "not implemented", "" if quiet else "n", "" if quiet else "NOT IMPLEMENTED"
    return (report.outcome, "", "") if quiet else None


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    results = list(config.stash.get(RESULTS, {}).values())
    if not results:
        return
    if config.getoption("--lane-record"):
        return  # a lane of --jobs: the process that started it prints the summary of every lane
    context = current()
    failed = [result for result in results if result.status not in ("passed", "skipped", "not implemented")]
    if failed and not shows_every_failure(config):
        terminalreporter.section("failures")
        for line in failure_summary(failed):
            terminalreporter.write_line(line)
    elif any(result.nodeid in config.stash.get(GRADED_ELSEWHERE, set()) for result in failed):
        terminalreporter.section("failures")  # pytest printed none of these here: they ran in other processes
        for result in (result for result in failed if result.nodeid in config.stash[GRADED_ELSEWHERE]):
            terminalreporter.write_line(f"{result.problem.id}: {result.nodeid}")
            for line in shown(result.detail).splitlines() or [shown(f"[{result.status}] {result.message}")]:
                terminalreporter.write_line("    " + line)
    terminalreporter.section("score")
    terminalreporter.write_line(f"impl: {context.impl.path}   profile: {context.profile}   device: {context.device}")
    for line in score_table(by_problem(results), isolation_line(context.isolation.level, context.isolation_note),
                            config.stash.get(GPU_ONLY_DTYPES, {})):
        terminalreporter.write_line(line)


REFERENCE_MODIFIED_STATUS = 3


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if RESULTS not in config.stash:
        return
    context = current()
    context.isolation.close()
    store = config.stash.get(EXPECTATIONS, None)
    if store is not None and store.mode == "record":
        store.write(store.problems)
    if context.impl_copy is not None:
        shutil.rmtree(context.impl_copy.path.parent, ignore_errors=True)
    if REFERENCE_HASHES in config.stash:
        now = reference_lock.fingerprint(context.reference.path)
        changed = reference_lock.changes(config.stash[REFERENCE_HASHES], now)
        if changed:
            session.exitstatus = REFERENCE_MODIFIED_STATUS
            config.get_terminal_writer().line(
                f"reference modified during grading ({', '.join(changed[:5])}): no results written", red=True
            )
            return
    path = config.getoption("--results-json", None)
    if not path:
        return
    results = list(config.stash[RESULTS].values())
    spans = config.stash[PROBLEM_SPAN]
    extra = {"problem_seconds": {problem_id: round(end - start, 2) for problem_id, (start, end) in spans.items()},
             "profile": context.profile, "impl": str(context.impl.path), "device": str(context.device),
             "isolation": context.isolation.level, "isolation_note": context.isolation_note}
    data = results_json(results, by_problem(results), time.monotonic() - config.stash[STARTED], extra,
                        isolation_line(context.isolation.level, context.isolation_note),
                        config.stash.get(GPU_ONLY_DTYPES, {}))
    if sandbox_warning():
        data["output"] = f"{sandbox_warning()}\n{data['output']}"
    key = config.stash[RESULTS_KEY]
    if key is not None:
        data = seal.sign(data, key, config.getoption("--results-nonce"))
    seal.write_atomically(Path(path), json.dumps(data, indent=2))
