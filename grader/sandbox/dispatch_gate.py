"""A Triton problem's compute rule held at torch's dispatcher, below every switch Python code can turn.

The operator recorder (grader.sandbox.guards.ForbiddenOpRecorder) is a TorchDispatchMode: code inside
`torch._C._DisableTorchDispatch()` or `_disable_current_modes()`, or in a thread no mode reaches, computes unseen by
it. This gate is installed in the worker before the student's module is imported: for every aten operator outside
grader.sandbox.allowed_ops.ALLOWED_OPS it registers a kernel for the CPU key (and the CUDA key on a GPU) that runs
the operator's own kernel for that key and, while an allowlist recorder is active, notes the operator in it, unless
Triton's own code called it. Python dispatch modes, inference mode, autograd switches and threads all end at these
kernels. The notes go to the active recorders, objects the student's source cannot name (the source policy refuses
imports of the grader, private attributes, gc and sys); registering torch's kernels over again would undo the gate,
and the same policy refuses torch.library. So it is still evidence gathered in the student's process, held one layer
below the one a line of Python switches off.
"""

from __future__ import annotations

import warnings

import torch

from grader.sandbox.allowed_ops import ALLOWED_OPS

_LIBRARY: torch.library.Library | None = None


def _packet(op_name: str) -> str:
    """'aten::mm.out' -> 'aten.mm', the name the recorders and their messages use."""
    return ".".join(op_name.replace("::", ".", 1).split(".")[:2])


def gated_ops(key: str) -> list[str]:
    """Every aten operator overload with a kernel that runs for `key` that is not on the allowlist."""
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    return [
        name for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::") and _packet(name) not in ALLOWED_OPS
        and (has_kernel(name, key) or has_kernel(name, "CompositeExplicitAutograd"))
    ]


def _kind(dtype: torch.dtype) -> int:
    return 0 if dtype == torch.bool else 3 if dtype.is_complex else 2 if dtype.is_floating_point else 1


def _as_wrapped(number, beside: torch.dtype | None) -> torch.Tensor:
    """A Python number torch passed for a Tensor argument (a "wrapped number", which reaches a Python kernel as the
    number), as a 0-dim tensor that promotes as the wrapped number did: of the tensors' dtype where the number's kind
    (bool < int < float < complex) is not higher, else of the default dtype of its own kind."""
    kind = 0 if isinstance(number, bool) else 1 if isinstance(number, int) else 3 if isinstance(number, complex) else 2
    if beside is not None and kind <= _kind(beside):
        dtype = beside
    else:
        default = torch.get_default_dtype()
        complex_default = torch.complex128 if default == torch.float64 else torch.complex64
        dtype = (torch.bool, torch.int64, default, complex_default)[kind]
    return torch.tensor(number, dtype=dtype)


def _tensor_slots(op_name: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The positions and keyword names of an operator's Tensor arguments."""
    base, _, overload = op_name.removeprefix("aten::").partition(".")
    schema = getattr(getattr(torch.ops.aten, base), overload or "default")._schema
    tensors = [(index, argument) for index, argument in enumerate(schema.arguments)
               if str(argument.type) in ("Tensor", "Optional[Tensor]")]
    return (tuple(index for index, argument in tensors if not argument.kwarg_only),
            tuple(argument.name for _, argument in tensors if argument.kwarg_only))


def _rewrap(args: tuple, kwargs: dict, positions: tuple[int, ...], names: tuple[str, ...]) -> tuple[tuple, dict]:
    """args and kwargs with each Python number in a Tensor slot made a tensor again (see _as_wrapped)."""
    numbers = (bool, int, float, complex)
    slots = [args[i] for i in positions if i < len(args)] + [kwargs[n] for n in names if n in kwargs]
    if not any(isinstance(value, numbers) for value in slots):
        return args, kwargs
    beside = None
    for value in slots:
        if isinstance(value, torch.Tensor):
            beside = value.dtype if beside is None else torch.promote_types(beside, value.dtype)
    args = tuple(_as_wrapped(a, beside) if i in positions and isinstance(a, numbers) else a for i, a in enumerate(args))
    kwargs = {n: _as_wrapped(v, beside) if n in names and isinstance(v, numbers) else v for n, v in kwargs.items()}
    return args, kwargs


def install(note) -> int:
    """Register the gate once per process; `note(op_name)` is called for each gated operator that runs (before it
    runs). Returns the number of kernels registered."""
    global _LIBRARY
    if _LIBRARY is not None:
        return 0
    keys = ["CPU"] + (["CUDA"] if torch.cuda.is_available() else [])
    library = torch.library.Library("aten", "IMPL")
    registered = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each registration warns that it overrides torch's kernel: it does, on purpose
        for key in keys:
            for name in gated_ops(key):
                kernel = torch.library.get_kernel(name, key)
                positions, names = _tensor_slots(name)

                def gated(keyset, *args, _kernel=kernel, _packet=_packet(name), _slots=(positions, names), **kwargs):
                    note(_packet)
                    if _slots != ((), ()):
                        args, kwargs = _rewrap(args, kwargs, *_slots)
                    return _kernel.call_boxed(keyset, *args, **kwargs)

                library.impl(name.removeprefix("aten::"), gated, key, with_keyset=True)
                registered += 1
    _LIBRARY = library
    return registered
