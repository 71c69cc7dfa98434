"""What the three linear-attention problems share: their inputs, the float64 recurrence every form is measured
against, the probe that watches a student's form run inside the worker, and the comparisons.

The three problems are one recurrence with more or less in it. Per batch and head, with a state S of shape [K, V]:

    linear_attention:  S_t = S_{t-1} + phi(k_t) v_t^T                                  o_t = S_t^T phi(q_t)
    mamba2:            S_t = exp(g_t) S_{t-1} + k_t v_t^T                              o_t = S_t^T q_t
    gated_deltanet:    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T  o_t = S_t^T q_t

with phi(x) = elu(x) + 1. `recurrence_stepwise` evaluates any of them step by step; in float64 in the grader's process
it is the oracle, with no reference in it. The reference's chunked form at the case's dtype is the yardstick of the
tolerance (grader.checks.compare).

The probe runs a student's form in the worker (`student.run_program`) and records what the grader's rules are about:
in the chunked forward, every aten operator outside the allowlist of allocation, views and copies
(grader.sandbox.allowed_ops), the Triton launches and what they read and wrote (grader.sandbox.triton_traffic); in
both passes, the number of launches (a few per chunk at most: `check_launch_count`) and every tensor larger than the
chunked algorithm needs (a T x T matrix, a state per step). These are in-process observations: they name an honest
mistake, not code that hides from them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from grader.checks.compare import assert_close, assert_raises
from grader.checks.outcomes import RuleViolation, WrongAnswer
from grader.checks.strategies import dims, size_scale
from grader.sandbox.client import check_triton_traffic
from grader.session.context import current

CHUNK_SIZES = (16, 32, 64)
HEAD_DIMS = (16, 32, 64, 128)
# g regimes: none (g = 0 exactly, no decay), weak (exp(g) near 1), mixed (from near 1 to near 0), strong (exp(g) near
# 0: the state forgets within a few tokens, and a product of decays over a chunk underflows in linear space).
DECAYS = ("none", "weak", "mixed", "strong")
# beta regimes: mixed (0 to 1), near 0 (the state barely changes) and near 1 (k_t's slot is overwritten whole).
BETAS = ("mixed", "near0", "near1")
LAYOUTS = ("contiguous", "bthd")  # bthd: views of [batch, seq, heads, dim] tensors, as a projection gives


@dataclass(frozen=True)
class Recurrence:
    """One problem's forms: the student functions, and which of g, beta, the initial and final state it has."""

    problem: str
    chunked: str
    recurrent: str
    parallel: str | None = None
    gates: tuple[str, ...] = ()
    feature_map: bool = False

    @property
    def has_state(self) -> bool:
        return bool(self.gates)


LINEAR_ATTENTION = Recurrence("linear_attention", "linear_attention_chunked", "linear_attention_recurrent",
                              parallel="linear_attention_parallel", feature_map=True)
MAMBA2 = Recurrence("mamba2", "mamba2_chunked", "mamba2_recurrent", gates=("g",))
GATED_DELTANET = Recurrence("gated_deltanet", "gated_deltanet_chunked", "gated_deltanet_recurrent",
                            gates=("g", "beta"))


@dataclass(frozen=True)
class LinearCase:
    recurrence: Recurrence = field(repr=False)
    batch: int
    heads: int
    seq: int
    k_dim: int
    v_dim: int
    dtype: torch.dtype
    chunk_size: int = 64
    layout: str = "contiguous"
    decay: str = "mixed"
    beta: str = "mixed"
    initial_state: bool = False
    seed: int = 0
    # "state": only the final state's gradient flows back (o unused downstream: autograd may pass its gradient as
    # None, which a backward must take as zeros); "both": o's and the final state's.
    upstream: str = "both"

    @property
    def names(self) -> tuple[str, ...]:
        """The tensor arguments of a call, in order."""
        return ("q", "k", "v", *self.recurrence.gates) + (("initial_state",) if self.initial_state else ())

    def travels_in(self, name: str) -> torch.dtype:
        """The dtype an input or upstream gradient is given in: q, k, v and dO in the case's, the rest float32."""
        return self.dtype if name in ("q", "k", "v", "grad_o") else torch.float32

    def exact_inputs(self) -> dict[str, torch.Tensor]:
        """Every input and upstream gradient in float64 on the CPU, holding exactly the values the call gets."""
        generator = torch.Generator().manual_seed(self.seed)
        b, h, t = self.batch, self.heads, self.seq

        def normal(*shape):
            return torch.randn(shape, generator=generator, dtype=torch.float64)

        q, k, v = normal(b, h, t, self.k_dim), normal(b, h, t, self.k_dim), normal(b, h, t, self.v_dim)
        if self.recurrence.problem == "gated_deltanet":
            k = F.normalize(k, dim=-1)  # the caller's L2 normalisation (pinned: not the function's)
        if self.recurrence.problem != "linear_attention":
            q = q / math.sqrt(self.k_dim)  # the caller's scaling, so that outputs stay O(1) over long sequences
        values = {"q": q, "k": k, "v": v}
        if "g" in self.recurrence.gates:
            values["g"] = log_decays(self.decay, (b, h, t), generator)
        if "beta" in self.recurrence.gates:
            values["beta"] = betas(self.beta, (b, h, t), generator)
        if self.initial_state:
            values["initial_state"] = normal(b, h, self.k_dim, self.v_dim)
        values["grad_o"] = normal(b, h, t, self.v_dim) * (self.upstream != "state")
        if self.recurrence.has_state:
            values["grad_state"] = normal(b, h, self.k_dim, self.v_dim)
        return {name: tensor.to(self.travels_in(name)).double() for name, tensor in values.items()}

    def inputs(self) -> dict[str, torch.Tensor]:
        """The inputs at their dtypes on the grader's device, q, k, v laid out as the case says."""
        exact = self.exact_inputs()
        device = current().device
        tensors = {name: tensor.to(self.travels_in(name)) for name, tensor in exact.items()}
        for name in ("q", "k", "v"):
            tensors[name] = laid_out(tensors[name], self.layout, device)
        return {name: tensor if name in ("q", "k", "v") else tensor.to(device) for name, tensor in tensors.items()}

    def describe(self) -> str:
        gates = "".join(f", {name}={getattr(self, 'decay' if name == 'g' else 'beta')}"
                        for name in self.recurrence.gates)
        state = ", initial_state=given" if self.initial_state else ""
        state += ", gradient through the final state only (None for o)" if self.upstream == "state" else ""
        return (f"batch={self.batch}, heads={self.heads}, seq={self.seq}, K={self.k_dim}, V={self.v_dim}, "
                f"dtype={str(self.dtype).removeprefix('torch.')}, chunk_size={self.chunk_size}, layout={self.layout}"
                f"{gates}{state}, seed={self.seed}")


def laid_out(tensor: torch.Tensor, layout: str, device) -> torch.Tensor:
    if layout == "contiguous":
        return tensor.to(device)
    if layout == "bthd":  # stored [batch, seq, heads, dim], viewed as [batch, heads, seq, dim]
        return tensor.transpose(1, 2).contiguous().to(device).transpose(1, 2)
    raise ValueError(f"unknown layout {layout!r}")


def log_decays(regime: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """g <= 0 in float64 for one regime."""
    noise = torch.randn(shape, generator=generator, dtype=torch.float64)
    if regime == "none":
        return torch.zeros(shape, dtype=torch.float64)
    if regime == "weak":
        return -F.softplus(noise) * 0.02
    if regime == "mixed":
        return -F.softplus(2 * noise)
    if regime == "strong":
        return -F.softplus(noise) * 10 - 5
    raise ValueError(f"unknown decay regime {regime!r}")


def betas(regime: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """beta in (0, 1) in float64 for one regime."""
    noise = torch.randn(shape, generator=generator, dtype=torch.float64)
    if regime == "mixed":
        return torch.sigmoid(2 * noise)
    if regime == "near0":
        return torch.sigmoid(noise - 8)
    if regime == "near1":
        return torch.sigmoid(noise + 8)
    raise ValueError(f"unknown beta regime {regime!r}")


def sequence_lengths(max_seq: int) -> st.SearchStrategy[int]:
    """T from 1 up, favouring 1, small primes and one either side of every chunk size."""
    return dims(max_seq, tiles=CHUNK_SIZES)


@st.composite
def linear_cases(draw, recurrence: Recurrence, dtypes: tuple[torch.dtype, ...], seq=None, head_dims=None,
                 decay=None, chunk_size=None, initial_state=None) -> LinearCase:
    """Cases of the given dtypes: sequences up to 40 under `ci` on a CPU (longer with more room), K and V up to 32
    there and up to 128 with more room, every regime, both layouts, at most 3 (batch, head) pairs under `ci`."""
    max_pairs = min(3 * size_scale(), 8)
    batch = draw(st.integers(1, max_pairs))
    sizes = head_dims if head_dims is not None else st.sampled_from([d for d in HEAD_DIMS if d <= 32 * size_scale()])
    return LinearCase(
        recurrence=recurrence,
        batch=batch,
        heads=draw(st.integers(1, max_pairs // batch)),
        seq=draw(seq if seq is not None else sequence_lengths(40 * size_scale())),
        k_dim=draw(sizes),
        v_dim=draw(sizes),
        dtype=draw(st.sampled_from(dtypes)),
        chunk_size=draw(chunk_size if chunk_size is not None else st.sampled_from(CHUNK_SIZES)),
        layout=draw(st.sampled_from(LAYOUTS)),
        decay=draw(decay if decay is not None else st.sampled_from(DECAYS)),
        beta=draw(st.sampled_from(BETAS)),
        initial_state=draw(initial_state if initial_state is not None else st.booleans()) and recurrence.has_state,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def worked_example(recurrence: Recurrence) -> LinearCase:
    return LinearCase(recurrence=recurrence, batch=2, heads=2, seq=37, k_dim=16, v_dim=32, dtype=torch.float32,
                      chunk_size=16, layout="bthd", decay="mixed", beta="mixed", initial_state=recurrence.has_state,
                      seed=5)


# --- the oracle ---------------------------------------------------------------------------------------------------


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1


def recurrence_stepwise(recurrence: Recurrence, q, k, v, g=None, beta=None, initial_state=None):
    """(o, final state) of the recurrence, step by step in the inputs' dtype; differentiable."""
    if recurrence.feature_map:
        q, k = elu_plus_one(q), elu_plus_one(k)
    batch, heads, seq, k_dim = q.shape
    state = (initial_state if initial_state is not None
             else q.new_zeros(batch, heads, k_dim, v.shape[-1]))
    outputs = []
    for t in range(seq):
        k_t, v_t = k[:, :, t], v[:, :, t]
        if g is not None:
            state = state * torch.exp(g[:, :, t])[..., None, None]
        if beta is not None:  # exp(g)(I - beta k k^T) S + beta k v^T, the decay applied first
            v_t = beta[:, :, t, None] * (v_t - torch.einsum("bhk,bhkv->bhv", k_t, state))
        state = state + k_t[..., :, None] * v_t[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    return torch.stack(outputs, dim=2), state


@dataclass
class Exact:
    """The oracle's answer for a case: outputs, and the gradients of every tensor argument by name."""

    output: torch.Tensor
    state: torch.Tensor | None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


def exact(case: LinearCase, gradients: bool = True) -> Exact:
    values = case.exact_inputs()
    tensors = {name: values[name].clone().requires_grad_(gradients) for name in case.names}
    output, state = recurrence_stepwise(case.recurrence, **tensors)
    answer = Exact(output.detach(), state.detach() if case.recurrence.has_state else None)
    if gradients:
        loss = (output * values["grad_o"]).sum()
        if case.recurrence.has_state:
            loss = loss + (state * values["grad_state"]).sum()
        loss.backward()
        answer.grads = {name: tensor.grad for name, tensor in tensors.items()}
    return answer


# --- the probe ----------------------------------------------------------------------------------------------------


class _LargeTensorRecorder(TorchDispatchMode):
    """Records every tensor an operator returns that holds more bytes than `limit` float32 elements or has two
    dimensions of length `seq` (a T x T matrix). Bytes, not elements: Triton's interpreter copies kernel arguments
    as bytes."""

    def __init__(self, limit: int, seq: int):
        super().__init__()
        self.limit, self.seq = limit, seq
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for tensor in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(tensor, torch.Tensor) and len(self.seen) < 6 and (
                    tensor.numel() * tensor.element_size() > 4 * self.limit
                    or sum(size == self.seq for size in tensor.shape) >= 2):
                self.seen.append(f"{func} -> {tuple(tensor.shape)}")
        return result


def element_limit(batch: int, heads: int, seq: int, k_dim: int, v_dim: int, chunk_size: int) -> int:
    """The most elements one tensor of the chunked algorithm needs: a state per chunk boundary ((T/C + 1) x K x V per
    batch and head), or a [T, max(K, V, C)] slab per batch and head (the inputs, the outputs, a [C, C] block per
    chunk). A T x T matrix or a state per step exceeds it once T is a few times the largest of K, V and C."""
    chunks = -(-seq // chunk_size)
    padded = chunks * chunk_size
    return batch * heads * max((chunks + 1) * k_dim * v_dim, padded * max(k_dim, v_dim, chunk_size))


def probe(module, function: str, names: list[str], args: list, kwargs: dict, upstream: list | None,
          triton_forward: bool, limit: int | None = None, seq: int = 0, forbidden_ops: tuple[str, ...] = ()) -> dict:
    """Run module.function(*args, **kwargs) (and its backward from `upstream`, one gradient or None per output) under
    observation. With triton_forward, torch may only allocate, view and copy in the forward, which must launch Triton
    kernels that read every input and write every output. With `limit`, every tensor built in either pass larger than
    `limit` elements, or T x T, is recorded."""
    from grader.sandbox import guards, triton_hooks
    from grader.sandbox.allowed_ops import ALLOWED_OPS
    from grader.sandbox.triton_traffic import TRAFFIC

    inputs = [a.detach().requires_grad_(upstream is not None and a.is_floating_point())
              if isinstance(a, torch.Tensor) else a for a in args]
    large = _LargeTensorRecorder(limit, seq) if limit is not None else contextlib.nullcontext()
    forward_rules = guards.ForbiddenOpRecorder(tuple(forbidden_ops), ALLOWED_OPS if triton_forward else None)
    report: dict = {"grads": None, "backward_launches": [], "backward_programs": []}
    triton_hooks.LAUNCHES.reset()
    with TRAFFIC.recording() if triton_forward else contextlib.nullcontext(), large:
        with forward_rules:
            result = getattr(module, function)(*inputs, **kwargs)
        report["forward_launches"] = list(triton_hooks.LAUNCHES.names)
        report["forward_programs"] = list(triton_hooks.LAUNCHES.programs)
        outputs = list(result) if isinstance(result, (tuple, list)) else [result]
        if triton_forward:
            report["unread"] = TRAFFIC.unread({name: a for name, a in zip(names, args) if isinstance(a, torch.Tensor)})
            report["unwritten"] = TRAFFIC.unwritten({f"output {i}": out for i, out in enumerate(outputs)})
            report["widest_block"] = TRAFFIC.widest_block
        if upstream is not None:
            pairs = [(out, up) for out, up in zip(outputs, upstream)
                     if up is not None and isinstance(out, torch.Tensor) and out.requires_grad]
            backward_rules = guards.ForbiddenOpRecorder(tuple(forbidden_ops))
            triton_hooks.LAUNCHES.reset()
            if pairs:
                with backward_rules:
                    torch.autograd.backward([out for out, _ in pairs], [up for _, up in pairs])
            report["backward_launches"] = list(triton_hooks.LAUNCHES.names)
            report["backward_programs"] = list(triton_hooks.LAUNCHES.programs)
            report["grads"] = [a.grad.detach() if isinstance(a, torch.Tensor) and a.grad is not None else None
                               for a in inputs]
            report["backward_forbidden"] = backward_rules.seen
            report["requires_grad"] = bool(pairs)
    report["outputs"] = [out.detach() if isinstance(out, torch.Tensor) else out for out in outputs]
    report["result_type"] = type(result).__name__
    report["large"] = large.seen if limit is not None else []
    report["forbidden"] = forward_rules.seen
    report["computed"] = forward_rules.computed
    return report


# --- running the student's forms ----------------------------------------------------------------------------------


def call_args(case: LinearCase, tensors: dict[str, torch.Tensor]) -> list:
    """The positional arguments of any form: q, k, v, the gates, and the initial state (None when not given)."""
    args = [tensors[name] for name in ("q", "k", "v", *case.recurrence.gates)]
    return args + [tensors.get("initial_state")] if case.recurrence.has_state else args


def arg_names(case: LinearCase) -> list[str]:
    names = ["q", "k", "v", *case.recurrence.gates]
    return names + ["initial_state"] if case.recurrence.has_state else names


def upstream_of(case: LinearCase, tensors: dict[str, torch.Tensor]) -> list:
    grad_o = None if case.upstream == "state" else tensors["grad_o"]
    return [grad_o, tensors["grad_state"]] if case.recurrence.has_state else [grad_o]


def run_form(student, case: LinearCase, form: str, tensors: dict, backward: bool = False, grader_work=None,
             limit: int | None = None, forbidden_ops: tuple[str, ...] = ()) -> tuple[dict, object]:
    """(the probe's report on the student's `form`, after the rules are checked, grader_work()): `form` is "chunked",
    "recurrent" or "parallel"."""
    function = getattr(case.recurrence, form)
    chunked = form == "chunked"
    kwargs = {"chunk_size": case.chunk_size} if chunked else {}
    shown = f"{function}({', '.join(case.names)}{', chunk_size=' + str(kwargs['chunk_size']) if chunked else ''})"
    with student.describing(case.describe()):
        report, grader_value = student.run_program_beside(
            grader_work, f"{__name__}:probe", function, arg_names(case), call_args(case, tensors), kwargs,
            upstream_of(case, tensors) if backward else None, chunked, limit, case.seq, forbidden_ops)
    check_rules(report, shown, chunked, backward, case.describe())
    if chunked:
        check_launch_count(report, case, shown)
    return report, grader_value


# Triton launches one pass of a chunked form may make: a few per chunk (a kernel per chunk for a walk over the
# chunks is slow but chunked) plus a few for the whole call. One launch per token exceeds it once T is a few times
# LAUNCHES_PER_CHUNK * chunks + LAUNCHES_PER_CALL, as in the tests that draw T of 129 and more with C = 16.
LAUNCHES_PER_CHUNK = 4
LAUNCHES_PER_CALL = 8


# Programs one launch may run: PROGRAMS_PER_TILE for each 16 tokens, each 16 x 16 tile of the [K, V] state, each
# batch and head. The finest grid a chunk's matrix products need is one program per 16-row block (tl.dot's least
# size) and state tile; the reference runs at most one program per chunk and tile of its own (larger) blocks. A grid
# of one program per token or per output element redoes a block's work in every program: it exceeds the bound.
PROGRAMS_PER_TILE = 2
TILE = 16


def programs_bound(case: LinearCase) -> int:
    tiles = -(-case.k_dim // TILE) * -(-case.v_dim // TILE)
    return PROGRAMS_PER_TILE * case.batch * case.heads * -(-case.seq // TILE) * tiles


def check_launch_count(report: dict, case: LinearCase, shown: str) -> None:
    """Each pass of the chunked form launches at most LAUNCHES_PER_CHUNK kernels per chunk plus LAUNCHES_PER_CALL
    (work launched per token is a recurrence, whatever the kernels inside it compute), and no launch runs more than
    programs_bound(case) programs (a grid per token or per element repeats a block's work). The programs are those
    of the launch's resolved grid (the interpreter's own; a compiled kernel's, resolved from its arguments): recorded
    inside the student's process, they catch honest designs, not a hostile one."""
    chunks = -(-case.seq // case.chunk_size)
    bound = LAUNCHES_PER_CHUNK * chunks + LAUNCHES_PER_CALL
    for direction in ("forward", "backward"):
        launches = report[f"{direction}_launches"]
        if len(launches) > bound:
            counted = ", ".join(f"{launches.count(name)} x {name}" for name in dict.fromkeys(launches))
            raise RuleViolation(
                f"{shown} made {len(launches)} Triton launches in its {direction} ({counted}) for T = {case.seq} "
                f"tokens in {chunks} chunks of {case.chunk_size}; at most {bound} are allowed ({LAUNCHES_PER_CHUNK} "
                f"per chunk + {LAUNCHES_PER_CALL}): launching per token runs the recurrence, not the chunked form "
                f"({case.describe()})")
        most = programs_bound(case)
        for name, programs in zip(launches, report[f"{direction}_programs"]):
            if programs is not None and programs > most:
                raise RuleViolation(
                    f"{shown} launched {name} with a grid of {programs} programs in its {direction}; at most {most} "
                    f"are allowed ({PROGRAMS_PER_TILE} per batch, head, {TILE} tokens and {TILE} x {TILE} tile of the "
                    f"[K, V] state): a program per token or per element repeats its block's work ({case.describe()})")


def check_rules(report: dict, shown: str, chunked: bool, backward: bool, context: str) -> None:
    forbidden = report["forbidden"] + report.get("backward_forbidden", [])
    if forbidden:
        raise RuleViolation(f"{shown} called {', '.join(forbidden)}, which this problem may not use ({context})")
    if not chunked:
        return
    if not report["forward_launches"]:
        raise RuleViolation(f"{shown} launched no Triton kernel in its forward: the chunked form is your Triton "
                            f"kernels' work ({context})")
    if report["computed"]:
        raise RuleViolation(f"{shown} computed with {', '.join(report['computed'])} outside a Triton kernel in its "
                            f"forward: there torch may only allocate, view and copy tensors ({context})")
    check_triton_traffic(report, shown, context)


def outputs_of(report: dict, case: LinearCase, shown: str, context: str) -> tuple:
    """(o, final state or None) from what a form returned, in the shape the contract pins."""
    outputs = report["outputs"]
    if case.recurrence.has_state:
        if report["result_type"] not in ("tuple", "list") or len(outputs) != 2:
            raise WrongAnswer(f"{shown} must return (o, final_state); it returned {report['result_type']} "
                              f"({context})")
        return outputs[0], outputs[1]
    if report["result_type"] in ("tuple", "list"):
        raise WrongAnswer(f"{shown} must return the tensor o; it returned a {report['result_type']} ({context})")
    return outputs[0], None


# --- expectations ---------------------------------------------------------------------------------------------------


def reference_at_dtype(reference, case: LinearCase, tensors: dict, backward: bool) -> dict:
    """The reference's chunked form at the case's dtype: its output, final state and gradients, the yardstick of the
    tolerances. Called through reference.computed, so that the students' copy replays it."""
    report = probe(reference, case.recurrence.chunked, arg_names(case), call_args(case, tensors),
                   {"chunk_size": case.chunk_size},
                   upstream_of(case, tensors) if backward else None, triton_forward=False)
    output, state = (report["outputs"] + [None])[:2]
    grads = dict(zip(arg_names(case), report["grads"] or ())) if backward else {}
    return {"output": output, "state": state if case.recurrence.has_state else None, "grads": grads}


def check_values(actual_output, actual_state, want: Exact, at_dtype: dict, case: LinearCase, tolerance: dict,
                 shown: str) -> None:
    """o and the final state against the oracle."""
    context = case.describe()
    assert_close(actual_output, want.output, at_dtype["output"], what=f"output o of {shown}", context=context,
                 **tolerance)
    if case.recurrence.has_state:
        assert_close(actual_state, want.state, at_dtype["state"], what=f"final_state of {shown}", context=context,
                     **tolerance)


def check_grads(report: dict, want: Exact, at_dtype: dict, case: LinearCase, tolerance: dict, shown: str) -> None:
    """The gradient of every tensor argument against the oracle's (of a loss sum(o * dO) + sum(S_T * dS))."""
    context = case.describe()
    if not report.get("requires_grad"):
        raise WrongAnswer(f"the outputs of {shown} do not require grad for inputs that do ({context})")
    for name, actual in zip(arg_names(case), report["grads"]):
        if name not in case.names:
            continue  # the initial state, not given
        if actual is None:
            raise WrongAnswer(f"gradient of {name}: {name} received no gradient from {shown} ({context})")
        assert_close(actual, want.grads[name], at_dtype["grads"][name], what=f"gradient of {name} from {shown}",
                     context=context, **tolerance)


def check_memory(report: dict, case: LinearCase, limit: int, shown: str) -> None:
    if report["large"]:
        raise WrongAnswer(
            f"{shown} built tensors larger than the chunked algorithm needs in its forward or backward: "
            f"{'; '.join(report['large'])}. At most {4 * limit} bytes per tensor here: a state per chunk boundary "
            f"(T/C + 1 states of [K, V] per batch and head) or a [T, max(K, V, C)] slab, never a T x T matrix "
            f"(T = {case.seq}) or a state per step ({case.describe()})")
    widest = report.get("widest_block")
    if widest is not None and max(widest[1]) > 128:
        raise WrongAnswer(f"Triton kernel `{widest[0]}` holds a block of shape {tuple(widest[1])}, longer than 128 "
                          f"along a dimension (T = {case.seq}): stream the sequence in chunks ({case.describe()})")


# --- invalid arguments: one fault each ----------------------------------------------------------------------------


def invalid_arguments(recurrence: Recurrence) -> list[tuple[str, dict, str]]:
    """(id, changes to a valid call, the exception it must raise): each names one fault."""
    faults = [
        ("value-length-differs", {"v": (1, 2, 7, 16)}, "ValueError"),
        ("heads-differ", {"k": (1, 3, 5, 16)}, "ValueError"),
        ("key-dim-differs", {"k": (1, 2, 5, 32)}, "ValueError"),
        ("3-D", {"q": (2, 5, 16), "k": (2, 5, 16), "v": (2, 5, 16)}, "ValueError"),
        ("K=24", {"q": (1, 2, 5, 24), "k": (1, 2, 5, 24)}, "ValueError"),
        ("V=256", {"v": (1, 2, 5, 256)}, "ValueError"),
        ("seq=0", {"q": (1, 2, 0, 16), "k": (1, 2, 0, 16), "v": (1, 2, 0, 16)}, "ValueError"),
        ("chunk_size=48", {"chunk_size": 48}, "ValueError"),
        ("float64", {"dtype": torch.float64}, "TypeError"),
        ("int32", {"dtype": torch.int32}, "TypeError"),
        ("mixed-dtypes", {"v_dtype": torch.float16}, "TypeError"),
    ]
    if "g" in recurrence.gates:
        faults += [("g-shape", {"g": (1, 2, 4)}, "ValueError"), ("g-float16", {"g_dtype": torch.float16}, "TypeError"),
                   ("state-shape", {"initial_state": (1, 2, 16, 32)}, "ValueError"),
                   ("state-float16", {"state_dtype": torch.float16}, "TypeError")]
    if "beta" in recurrence.gates:
        faults += [("beta-shape", {"beta": (1, 1, 5)}, "ValueError")]
    return faults


def invalid_call(recurrence: Recurrence, changes: dict, device) -> tuple[list, dict]:
    """The arguments of a call of the chunked form with one fault (q, k, v [1, 2, 5, 16] and their gates otherwise)."""
    dtype = changes.get("dtype", torch.float32)

    def make(name: str, shape: tuple[int, ...], tensor_dtype) -> torch.Tensor:
        shape = changes.get(name, shape)
        if tensor_dtype.is_floating_point:
            return torch.full(shape, 0.5 if name != "g" else -0.5, dtype=tensor_dtype, device=device)
        return torch.ones(shape, dtype=tensor_dtype, device=device)

    args = [make("q", (1, 2, 5, 16), dtype), make("k", (1, 2, 5, 16), dtype),
            make("v", (1, 2, 5, 16), changes.get("v_dtype", dtype))]
    if "g" in recurrence.gates:
        args.append(make("g", (1, 2, 5), changes.get("g_dtype", torch.float32)))
    if "beta" in recurrence.gates:
        args.append(make("beta", (1, 2, 5), torch.float32))
    if recurrence.has_state:
        args.append(make("initial_state", (1, 2, 16, 16), changes.get("state_dtype", torch.float32)))
    return args, {"chunk_size": changes.get("chunk_size", 16)}


def check_raises(student, recurrence: Recurrence, fault: str, changes: dict, expected_error: str) -> None:
    args, kwargs = invalid_call(recurrence, changes, current().device)
    shapes = ", ".join(f"{tuple(a.shape)} {str(a.dtype).removeprefix('torch.')}" for a in args)
    assert_raises(student.raises(recurrence.chunked, *args, **kwargs), expected_error,
                  f"{recurrence.chunked}({shapes}, chunk_size={kwargs['chunk_size']}) ({fault})")
