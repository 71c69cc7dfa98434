"""Runtime hooks on Triton that the grader installs before any kernel runs.

Three independent hooks, each safe to install more than once (the load, store and launch hooks also feed
grader.sandbox.triton_traffic, the evidence that kernels read the inputs and wrote the outputs):

* an address check for Triton's interpreter, which otherwise lets an unmasked
  out-of-bounds load read garbage, a store overwrite unrelated memory, or either
  one crash the whole process;
* autotuning without benchmarks under the interpreter, where there is no GPU to
  time configurations on;
* a launch recorder, so the grader can see which kernels a function launched,
  on the interpreter and on compiled GPU kernels alike.

Triton is imported lazily, inside the installers, so that importing this module
never decides the interpreter mode (TRITON_INTERPRET is read at Triton's import).
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from grader.sandbox.triton_traffic import TRAFFIC, byte_range
from grader.session import backend

# Attribute on every wrapper that holds the function it replaced; re-installing
# wraps that original again instead of stacking a second wrapper on top.
_ORIGINAL_ATTR = "_grader_hook_original"


def _patch(owner: type, name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    current = getattr(owner, name)
    original = getattr(current, _ORIGINAL_ATTR, current)
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, _ORIGINAL_ATTR, original)
    setattr(owner, name, wrapper)


def _interpreting() -> bool:
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return backend.interpreting()


def _kernel_name(kernel: Any) -> str:
    """Name of the Python function under a JIT, interpreted or autotuned kernel."""
    fn = kernel
    while not inspect.isfunction(fn) and hasattr(fn, "fn"):
        fn = fn.fn
    return getattr(fn, "__name__", type(kernel).__name__)


# --------------------------------------------------------------------------------------
# 1. Out-of-bounds check under the interpreter
# --------------------------------------------------------------------------------------


class TritonOutOfBounds(Exception):
    """An interpreted kernel addressed memory outside every tensor argument of its launch."""


@dataclass(frozen=True)
class _TensorExtent:
    """Byte range [start, end) spanned by one tensor argument as the kernel sees it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    start: int
    end: int


class _Launch:
    """The interpreted launch in progress: kernel name and the extents of its tensors."""

    def __init__(self, executor: Any, kernel_name: str) -> None:
        self.executor = executor
        self.kernel_name = kernel_name
        self.extents: list[_TensorExtent] = []
        self.starts = np.zeros(0, dtype=np.uint64)
        self.ends = np.zeros(0, dtype=np.uint64)

    def set_extents(self, extents: list[_TensorExtent]) -> None:
        self.extents = extents
        self.starts = np.array([e.start for e in extents], dtype=np.uint64)
        self.ends = np.array([e.end for e in extents], dtype=np.uint64)


# Interpreted launches do not nest, but a stack keeps a launch started from a
# pre-run hook from clobbering the outer one's extents.
_LAUNCHES_IN_FLIGHT: list[_Launch] = []


def _tensor_extent(name: str, arg: Any) -> _TensorExtent | None:
    import torch

    if isinstance(arg, torch.Tensor):
        tensor = arg
    elif isinstance(getattr(arg, "base", None), torch.Tensor):
        tensor = arg.base  # triton.reinterpret wrapper: the memory is the base tensor's
    else:
        return None
    if tensor.numel() == 0:
        return None
    dtype = str(tensor.dtype).removeprefix("torch.")
    return _TensorExtent(name, tuple(tensor.shape), dtype, *byte_range(tensor))


def _collect_extents(name: str, arg: Any, out: list[_TensorExtent]) -> None:
    if isinstance(arg, tuple):
        for i, item in enumerate(arg):
            _collect_extents(f"{name}[{i}]", item, out)
    elif hasattr(arg, "block_shape") and hasattr(arg, "base"):
        _collect_extents(f"{name}.base", arg.base, out)  # tensor descriptor
    elif hasattr(arg, "data_ptr"):
        extent = _tensor_extent(name, arg)
        if extent is not None:
            out.append(extent)


def _launch_extents(arg_names: list[str], args_hst: list[Any], kwargs_hst: dict[str, Any]) -> list[_TensorExtent]:
    extents: list[_TensorExtent] = []
    for i, arg in enumerate(args_hst):
        name = arg_names[i] if i < len(arg_names) else f"arg{i}"
        _collect_extents(name, arg, extents)
    for name, arg in kwargs_hst.items():
        _collect_extents(name, arg, extents)
    return extents


def _describe_address(address: int, access_bytes: int, extents: list[_TensorExtent]) -> str:
    """Place an address relative to the nearest tensor argument, in bytes."""
    if not extents:
        return f"address {address:#x} (the launch has no tensor arguments)"
    best_gap, best_text = None, ""
    for extent in extents:
        # Offsets wrap modulo 2**64 in the interpreter, so a negative index shows up
        # as a huge address; reading the difference as signed recovers it.
        offset = (address - extent.start + 2**63) % 2**64 - 2**63
        size = extent.end - extent.start
        if offset < 0:
            gap, where = -offset, f"{-offset} bytes before the start of"
        else:
            gap = offset + access_bytes - size
            where = f"{gap} bytes past the end of"
        if best_gap is None or gap < best_gap:
            best_gap = gap
            best_text = (f"address {address:#x} is {where} `{extent.name}` (shape {extent.shape}, {extent.dtype}; "
                         f"the {access_bytes}-byte access is at byte offset {offset} of a {size}-byte tensor)")
    return best_text


def _access_bytes(ptrs: Any) -> int:
    pointee = getattr(ptrs.dtype, "element_ty", None)
    return max(1, getattr(pointee, "primitive_bitwidth", 8) // 8)


def _active_addresses(ptrs: Any, mask: Any) -> np.ndarray:
    addresses = np.asarray(ptrs.data).astype(np.uint64, copy=False)
    if mask is None:
        return addresses.reshape(-1)
    return addresses[np.broadcast_to(np.asarray(mask.data).astype(bool, copy=False), addresses.shape)]


def _check_access(builder: Any, op: str, ptrs: Any, mask: Any) -> None:
    """Report the access to the traffic recorder, and raise TritonOutOfBounds unless every active lane's access lies
    inside one tensor argument."""
    if not _LAUNCHES_IN_FLIGHT:
        return
    launch = _LAUNCHES_IN_FLIGHT[-1]
    addresses = _active_addresses(ptrs, mask)
    TRAFFIC.note_access(op, addresses, lanes=int(np.size(ptrs.data)))
    if addresses.size == 0:
        return
    access_bytes = _access_bytes(ptrs)

    # Fast path: the whole block falls inside one tensor (the common case).
    lowest, highest = int(addresses.min()), int(addresses.max())
    for extent in launch.extents:
        if extent.start <= lowest and highest + access_bytes <= extent.end:
            return

    last_starts = launch.ends - np.uint64(access_bytes)
    inside = (addresses[:, None] >= launch.starts) & (addresses[:, None] <= last_starts)
    bad = ~inside.any(axis=1)
    if not bad.any():
        return
    first_bad = int(addresses[bad][0])
    program = tuple(int(i) for i in getattr(builder, "grid_idx", ()))
    raise TritonOutOfBounds(
        f"out-of-bounds {op} in Triton kernel `{launch.kernel_name}` (program_id {program}): "
        f"{int(bad.sum())} of {addresses.size} active lanes address memory outside every tensor argument; "
        f"first bad lane: {_describe_address(first_bad, access_bytes, launch.extents)}. "
        f"Mask the {op} so that lanes outside the tensor are inactive.")


def _find_out_of_bounds(error: BaseException) -> TritonOutOfBounds | None:
    """The interpreter re-wraps kernel errors in InterpreterError; dig the original out."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, TritonOutOfBounds):
            return error
        seen.add(id(error))
        error = error.__cause__
    return None


def _wrap_grid_call(original: Callable) -> Callable:

    def __call__(self, *args, **kwargs):
        _LAUNCHES_IN_FLIGHT.append(_Launch(self, self.fn.__name__))
        try:
            return original(self, *args, **kwargs)
        except Exception as error:
            out_of_bounds = _find_out_of_bounds(error)
            if out_of_bounds is None or out_of_bounds is error:
                raise
        finally:
            _LAUNCHES_IN_FLIGHT.pop()
        # Raised outside the handler so the caller sees TritonOutOfBounds itself,
        # not the interpreter's InterpreterError around its repr.
        raise out_of_bounds

    return __call__


def _wrap_init_args_hst(original: Callable) -> Callable:

    def _init_args_hst(self, args_dev, kwargs):
        # The kernel sees host copies of its tensors (the same memory for CPU
        # tensors, fresh buffers for GPU ones), so the extents come from these.
        args_hst, kwargs_hst = original(self, args_dev, kwargs)
        if _LAUNCHES_IN_FLIGHT and _LAUNCHES_IN_FLIGHT[-1].executor is self:
            _LAUNCHES_IN_FLIGHT[-1].set_extents(_launch_extents(self.arg_names, args_hst, kwargs_hst))
        return args_hst, kwargs_hst

    return _init_args_hst


def _wrap_load(original: Callable, op: str) -> Callable:

    def create_masked_load(self, ptrs, mask, *args, **kwargs):
        _check_access(self, op, ptrs, mask)
        return original(self, ptrs, mask, *args, **kwargs)

    return create_masked_load


def _wrap_store(original: Callable, op: str) -> Callable:

    def create_masked_store(self, ptrs, value, mask, *args, **kwargs):
        _check_access(self, op, ptrs, mask)
        return original(self, ptrs, value, mask, *args, **kwargs)

    return create_masked_store


def _wrap_atomic_rmw(original: Callable) -> Callable:

    def create_atomic_rmw(self, rmwOp, ptr, val, mask, *args, **kwargs):
        _check_access(self, "atomic", ptr, mask)
        return original(self, rmwOp, ptr, val, mask, *args, **kwargs)

    return create_atomic_rmw


def _wrap_atomic_cas(original: Callable) -> Callable:

    def create_atomic_cas(self, ptr, cmp, val, *args, **kwargs):
        _check_access(self, "atomic", ptr, None)
        return original(self, ptr, cmp, val, *args, **kwargs)

    return create_atomic_cas


def install_interpreter_bounds_check() -> None:
    """Check every active lane of interpreted loads, stores and atomics against the launch's tensors."""
    if not _interpreting():
        return
    from triton.runtime import interpreter

    _patch(interpreter.GridExecutor, "__call__", _wrap_grid_call)
    _patch(interpreter.GridExecutor, "_init_args_hst", _wrap_init_args_hst)
    builder = interpreter.InterpreterBuilder
    # Unmasked loads/stores, tensor descriptors and block pointers all end in
    # the masked builder ops; the atomic load/store ops (newer Triton) are hooked
    # too so their errors say "atomic".
    _patch(builder, "create_masked_load", lambda original: _wrap_load(original, "load"))
    _patch(builder, "create_masked_store", lambda original: _wrap_store(original, "store"))
    if hasattr(builder, "create_atomic_load"):
        _patch(builder, "create_atomic_load", lambda original: _wrap_load(original, "atomic"))
    if hasattr(builder, "create_atomic_store"):
        _patch(builder, "create_atomic_store", lambda original: _wrap_store(original, "atomic"))
    _patch(builder, "create_atomic_rmw", _wrap_atomic_rmw)
    _patch(builder, "create_atomic_cas", _wrap_atomic_cas)


# --------------------------------------------------------------------------------------
# 2. Autotuning under the interpreter
# --------------------------------------------------------------------------------------


def _keep_first_config(original: Callable) -> Callable:

    def prune_configs(self, *args, **kwargs):
        return original(self, *args, **kwargs)[:1]

    return prune_configs


def _skip_benchmark(original: Callable) -> Callable:

    def _bench(self, *args, **kwargs):
        # Only one config survives pruning, so any timing picks it.
        return [0.0, 0.0, 0.0]

    return _bench


def _skip_disk_cache(original: Callable) -> Callable:

    def check_disk_cache(self, tuning_key, configs, bench_fn):
        bench_fn()
        return False

    return check_disk_cache


def install_autotune_without_benchmarks() -> None:
    """Run autotuned kernels with their first config after pruning, without timing anything."""
    if not _interpreting():
        return
    from triton.runtime.autotuner import Autotuner

    # With a single pruned config, newer Triton skips benchmarking on its own;
    # older Triton still calls _bench (which needs a GPU driver) once per config.
    _patch(Autotuner, "prune_configs", _keep_first_config)
    _patch(Autotuner, "_bench", _skip_benchmark)
    if hasattr(Autotuner, "check_disk_cache"):
        _patch(Autotuner, "check_disk_cache", _skip_disk_cache)


# --------------------------------------------------------------------------------------
# 3. Launch recorder
# --------------------------------------------------------------------------------------


class LaunchRecorder:
    """Records the names of kernels launched since the last reset(), in launch order, and each launch's number of
    programs (the product of its grid; None where a compiled kernel's callable grid could not be resolved here).

    One launch is one `kernel[grid](...)` call: an autotuned kernel counts once,
    however many configurations it benchmarks (its programs are those of its last run, the chosen configuration's);
    warmup (compile-only) calls do not count.
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        self.programs: list[int | None] = []

    def install(self) -> None:
        _install_launch_hooks()
        if not any(recorder is self for recorder in _RECORDERS):
            _RECORDERS.append(self)

    def reset(self) -> None:
        self.names = []
        self.programs = []


def _note_programs(programs: int | None) -> None:
    """The launch running now (the last one recorded) runs `programs` programs."""
    if programs is None:
        return
    for recorder in _RECORDERS:
        if recorder.programs:
            recorder.programs[-1] = programs


def _grid_programs(kernel: Any, args: tuple, kwargs: dict) -> int | None:
    """The number of programs of a launch, its grid resolved as Triton resolves it (a callable grid gets the launch's
    arguments by name); None when the grid needs values the call does not name (an autotuner's configuration, which
    its inner launch names)."""
    grid = kwargs.get("grid")
    if callable(grid):
        try:
            grid = grid({**dict(zip(getattr(kernel, "arg_names", ()), args)), **kwargs})
        except (KeyError, TypeError, AttributeError):
            return None
    try:
        return int(np.prod([int(extent) for extent in grid]))
    except (TypeError, ValueError):
        return None


_RECORDERS: list[LaunchRecorder] = []
# Per thread, how many recorded launches are running: launches inside one (an
# autotuner's benchmark runs and final run) are part of it and not recorded.
_NESTING = threading.local()


def _record_launches(original: Callable) -> Callable:

    def run(self, *args, **kwargs):
        depth = getattr(_NESTING, "depth", 0)
        if kwargs.get("warmup", False):
            return original(self, *args, **kwargs)
        if depth:  # an autotuner's run of one configuration: its grid is the recorded launch's
            _note_programs(_grid_programs(self, args, kwargs))
            return original(self, *args, **kwargs)
        name = _kernel_name(self)
        programs = _grid_programs(self, args, kwargs)
        for recorder in _RECORDERS:
            recorder.names.append(name)
            recorder.programs.append(programs)
        _NESTING.depth = depth + 1
        try:
            kernel = original(self, *args, **kwargs)
        finally:
            _NESTING.depth = depth
        if TRAFFIC.active:
            TRAFFIC.note_arguments([(e.start, e.end) for e in _launch_extents([], list(args), kwargs)])
            asm = getattr(kernel, "asm", None)  # a compiled kernel's (GPU) code, by stage
            ir = asm.get("ttir") if isinstance(asm, dict) else None
            if isinstance(ir, str):  # its blocks, from its Triton IR
                TRAFFIC.note_ir(name, ir)
        return kernel

    return run


def _record_grid(original: Callable) -> Callable:

    def set_grid_dim(self, *grid):
        _note_programs(int(np.prod(grid)))
        return original(self, *grid)

    return set_grid_dim


def _record_blocks(original: Callable) -> Callable:

    def __post_init__(self):
        original(self)
        if TRAFFIC.active and _LAUNCHES_IN_FLIGHT and self.data.ndim >= 2:
            TRAFFIC.note_block(_LAUNCHES_IN_FLIGHT[-1].kernel_name, self.data.shape)

    return __post_init__


def _install_launch_hooks() -> None:
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    _patch(JITFunction, "run", _record_launches)
    _patch(Autotuner, "run", _record_launches)
    if _interpreting():
        from triton.runtime.interpreter import InterpretedFunction, InterpreterBuilder, TensorHandle

        _patch(InterpretedFunction, "run", _record_launches)
        # The interpreter's own resolved grid, whatever form the launch gave it in.
        _patch(InterpreterBuilder, "set_grid_dim", _record_grid)
        # Every value an interpreted kernel computes is a TensorHandle around a numpy array of the block's shape.
        _patch(TensorHandle, "__post_init__", _record_blocks)


LAUNCHES = LaunchRecorder()


def install_all() -> None:
    """Install every hook; safe to call again."""
    install_interpreter_bounds_check()
    install_autotune_without_benchmarks()
    LAUNCHES.install()
