"""What the two FlashAttention problems share: their inputs, the probe that watches an implementation run inside the
worker, and the comparisons of outputs, logsumexps and gradients.

The probe runs in the worker with the student's module (through `student.run_program`) and in the grader's process
with the reference's, so both are observed the same way: the output, the tensors FlashAttentionFunction saved for
backward, any tensor with two dimensions of the sequence length built along the way, the Triton kernels launched by
the forward and by the backward, and the gradients of a given upstream dO.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from assignment.registry import BY_ID
from grader.checks.compare import assert_close, assert_raises, check_tensor_form
from grader.checks.outcomes import RuleViolation, WrongAnswer
from grader.checks.strategies import dims, size_scale
from grader.sandbox.client import check_triton_traffic
from grader.session.context import current

TORCH_TILE_SIZE = 16  # the PyTorch problem's pinned TILE_SIZE (rows of a query tile and of a key tile)
# The Triton problem's tiles are its own, but no block of two or more dimensions in its kernels may exceed this along
# any dimension: a block of every key (or every query) of a longer sequence is not a tile.
TRITON_MAX_BLOCK = 128
FUNCTION_NODE = "FlashAttentionFunctionBackward"  # autograd's name for the node of FlashAttentionFunction.apply
# Laid out as given ([batch, heads, seq, head_dim]); as views of [batch, seq, heads, head_dim] tensors (what a
# projection followed by a transpose gives); as views of one packed [batch, seq, 3, heads, head_dim] tensor.
LAYOUTS = ("contiguous", "bnhd", "packed_qkv")
# normal: Gaussian q, k, v (scores of standard deviation 1); sharp: q six times larger (the row max moves a lot
# from key block to key block and the attention is nearly one-hot); ties: small integers (many equal scores).
REGIMES = ("normal", "sharp", "ties")
SHARP_FACTOR = 6.0


@dataclass(frozen=True)
class AttentionCase:
    batch: int
    heads: int
    seq: int
    head_dim: int
    dtype: torch.dtype
    is_causal: bool
    merged_heads: bool = False  # 3-D inputs [batch*heads, seq, head_dim]
    layout: str = "contiguous"
    regime: str = "normal"
    seed: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        if self.merged_heads:
            return (self.batch * self.heads, self.seq, self.head_dim)
        return (self.batch, self.heads, self.seq, self.head_dim)

    def exact_inputs(self) -> tuple[torch.Tensor, ...]:
        """q, k, v and the upstream gradient dO in float64 on the CPU, holding exactly the case's values."""
        generator = torch.Generator().manual_seed(self.seed)
        shape = (self.batch, self.heads, self.seq, self.head_dim)
        if self.regime == "ties":
            q, k, v = (torch.randint(-2, 3, shape, generator=generator).double() for _ in range(3))
        else:
            q, k, v = (torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(3))
            if self.regime == "sharp":
                q = q * SHARP_FACTOR
        grad_o = torch.randn(shape, generator=generator, dtype=torch.float64)
        return tuple(t.to(self.dtype).double().reshape(self.shape) for t in (q, k, v, grad_o))

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """q, k, v in the case's dtype, layout and device, and dO (contiguous, in the same dtype)."""
        q, k, v, grad_o = (t.to(self.dtype) for t in self.exact_inputs())
        device = current().device
        return (*laid_out((q, k, v), self.layout, device), grad_o.to(device))

    def describe(self) -> str:
        dims_ = "[batch*heads, seq, head_dim]" if self.merged_heads else "[batch, heads, seq, head_dim]"
        return (
            f"shape={self.shape} {dims_}, dtype={str(self.dtype).removeprefix('torch.')}, "
            f"is_causal={self.is_causal}, layout={self.layout}, values={self.regime}, seed={self.seed}"
        )


def laid_out(tensors: tuple[torch.Tensor, ...], layout: str, device) -> tuple[torch.Tensor, ...]:
    """The same values as the given (3-D or 4-D, contiguous) tensors, stored as `layout` says."""
    if layout == "contiguous":
        return tuple(t.to(device) for t in tensors)
    if layout == "bnhd":
        # Stored with seq before heads (or before batch*heads), viewed back.
        return tuple(t.transpose(-3, -2).contiguous().to(device).transpose(-3, -2) for t in tensors)
    if layout == "packed_qkv":
        packed = torch.stack([t.transpose(-3, -2) for t in tensors], dim=-3).contiguous().to(device)
        return tuple(packed.select(-3, index).transpose(-3, -2) for index in range(len(tensors)))
    raise ValueError(f"unknown layout {layout!r}")


# head_dim 48 is padded to a block of 64: the contract names such sizes (48, 80, 96, 112), which the `ci` profile on a
# CPU does not draw, so every profile grades one explicitly, its inputs laid out as views of [batch, seq, heads, dim].
PADDED_HEAD_DIM = AttentionCase(batch=1, heads=2, seq=33, head_dim=48, dtype=torch.float32, is_causal=False,
                                layout="bnhd", seed=7)


def head_dims() -> list[int]:
    """Multiples of 16 up to 32 under `ci` on a CPU, up to 128 with more room."""
    return [d for d in range(16, 129, 16) if d <= 32 * size_scale()]


def sequence_lengths(max_seq: int) -> st.SearchStrategy[int]:
    return dims(max_seq, tiles=(16, 32, 64, 128))


@st.composite
def attention_cases(
    draw,
    dtypes: tuple[torch.dtype, ...],
    causal: st.SearchStrategy[bool] = st.booleans(),
    seq: st.SearchStrategy[int] | None = None,
    head_dim: st.SearchStrategy[int] | None = None,
    max_pairs: int | None = None,
) -> AttentionCase:
    """Cases of the given dtypes; by default sequences up to 40 (3 tiles of 16) under `ci` on a CPU, longer with
    more room, and at most 3 (batch, head) pairs under `ci`, 16 anywhere (or max_pairs)."""
    max_pairs = max_pairs or min(3 * size_scale(), 16)
    batch = draw(st.integers(1, max_pairs))
    heads = draw(st.integers(1, max_pairs // batch))
    return AttentionCase(
        batch=batch,
        heads=heads,
        seq=draw(seq if seq is not None else sequence_lengths(40 * size_scale())),
        head_dim=draw(head_dim if head_dim is not None else st.sampled_from(head_dims())),
        dtype=draw(st.sampled_from(dtypes)),
        is_causal=draw(causal),
        merged_heads=draw(st.booleans()),
        layout=draw(st.sampled_from(LAYOUTS)),
        regime=draw(st.sampled_from(REGIMES)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# --- the probe ----------------------------------------------------------------------------------------------------


class _WideTensorRecorder(TorchDispatchMode):
    """Records every tensor an operator returns that has two dimensions of length `seq` (an n x n matrix) or, with
    `tile`, a dimension of length seq beside one of length tile (a tile of queries against every key, or of keys
    against every query)."""

    def __init__(self, seq: int, tile: int | None):
        super().__init__()
        self.seq = seq
        self.tile = tile
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for tensor in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(tensor, torch.Tensor) and len(self.seen) < 10 and (
                    is_square(tensor.shape, self.seq) or spans_all_keys(tensor.shape, self.seq, self.tile)):
                self.seen.append(f"{func} -> {tuple(tensor.shape)}")
        return result


def is_square(shape, seq: int) -> bool:
    return sum(1 for size in shape if size == seq) >= 2


def spans_all_keys(shape, seq: int, tile: int | None) -> bool:
    return tile is not None and seq in shape and tile in shape


def tile_rule(shape, tile: int) -> int | None:
    """`tile` when a dimension of that length beside one of length seq can only be a tile against a whole sequence:
    seq differs from the tile and neither is another dimension of q (batch, heads, head_dim); else None."""
    *others, seq, head_dim = shape
    return tile if seq != tile and not {seq, tile} & {*others, head_dim} else None


def _function_nodes(output, node_name: str) -> list:
    """The nodes named node_name (an autograd.Function's backward) in the autograd graph of `output`."""
    if not isinstance(output, torch.Tensor) or output.grad_fn is None:
        return []
    found, seen, stack = [], set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == node_name:
            found.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _tensor_attributes(node) -> list[str]:
    """'name: shape' for each tensor kept on the ctx as an attribute (directly or in a list, tuple or dict)."""
    found = []
    for name, value in vars(node).items():
        values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        found += [f"ctx.{name}: {tuple(t.shape)}" for t in values if isinstance(t, torch.Tensor)]
    return found


def probe(module, q, k, v, is_causal: bool, grad_o=None, forbidden_ops: tuple[str, ...] = (),
          uses_triton: bool = False) -> dict:
    """Run module.flash_attention(q, k, v, is_causal) (and its backward from grad_o, if given) under observation;
    with uses_triton, torch may only allocate, view and copy (grader.sandbox.allowed_ops)."""
    # The PyTorch problem pins its tiles (TILE_SIZE rows of queries and of keys); a Triton kernel's tiles are its own
    # blocks, which the traffic recorder sees.
    return observe(lambda *inputs: module.flash_attention(*inputs, is_causal=is_causal), FUNCTION_NODE, q, k, v,
                   grad_o, forbidden_ops, uses_triton, None if uses_triton else tile_rule(q.shape, TORCH_TILE_SIZE))


def observe(call, node_name: str, q, k, v, grad_o, forbidden_ops: tuple[str, ...], uses_triton: bool,
            tile: int | None, seq: int | None = None, read_whole: tuple[str, ...] = ("q", "k", "v")) -> dict:
    """Run call(q, k, v) (and its backward from grad_o, if given) under observation: the output, the tensors the
    autograd node `node_name` saved, any tensor spanning the sequence (of length `seq`, by default q's second last
    dimension) twice (or beside a `tile`), the operators and Triton launches of the forward and of the backward, the
    gradients. With uses_triton, the kernels must read every element of the inputs named in `read_whole` and of dO."""
    from grader.sandbox import guards, triton_hooks
    from grader.sandbox.allowed_ops import ALLOWED_OPS
    from grader.sandbox.triton_traffic import TRAFFIC

    inputs = [t.detach().requires_grad_(True) for t in (q, k, v)]
    squares = _WideTensorRecorder(q.shape[-2] if seq is None else seq, tile)
    forbidden = guards.ForbiddenOpRecorder(tuple(forbidden_ops), ALLOWED_OPS if uses_triton else None)
    report = {"saved": None, "lse": None, "ctx_tensors": [], "backward_launches": [], "grads": None}
    triton_hooks.LAUNCHES.reset()
    with TRAFFIC.recording() if uses_triton else contextlib.nullcontext(), forbidden, squares:
        output = call(*inputs)
        report["forward_launches"] = list(triton_hooks.LAUNCHES.names)
        nodes = _function_nodes(output, node_name)
        report["function_nodes"] = len(nodes)
        if len(nodes) == 1:
            saved = nodes[0].saved_tensors
            report["saved"] = [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in saved]
            report["lse"] = saved[4].detach().clone() if len(saved) >= 5 else None
            report["ctx_tensors"] = _tensor_attributes(nodes[0])
        if grad_o is not None and isinstance(output, torch.Tensor) and output.requires_grad:
            triton_hooks.LAUNCHES.reset()
            output.backward(grad_o)
            report["backward_launches"] = list(triton_hooks.LAUNCHES.names)
            report["grads"] = [None if t.grad is None else t.grad.detach() for t in inputs]
    report["output"] = output.detach() if isinstance(output, torch.Tensor) else output
    report["square_tensors"] = squares.seen
    report["forbidden"] = forbidden.seen
    report["computed"] = forbidden.computed
    if uses_triton:
        # (q, k, v share their memory with the detached inputs the call was given.)
        named = {"q": q, "k": k, "v": v}
        report["unread"] = TRAFFIC.unread({**{name: named[name] for name in read_whole},
                                           "the upstream gradient dO": grad_o})
        report["unwritten"] = TRAFFIC.unwritten({"the output": output, **{
            f"the gradient of {name}": g for name, g in zip("qkv", report["grads"] or ())}})
        report["widest_block"] = TRAFFIC.widest_block
    return report


# --- grading ------------------------------------------------------------------------------------------------------


def _probe_beside(student, case: AttentionCase, q, k, v, grad_o, uses_triton: bool, grader_work) -> tuple:
    """(the probe's report on the student's module, after the rules are checked (see check_rules), grader_work()),
    the grader's work done while the worker runs the probe."""
    with student.describing(case.describe()):
        report, grader_value = student.run_program_beside(
            grader_work, f"{__name__}:probe", q, k, v, case.is_causal, grad_o,
            BY_ID["kernels.flash_attention_torch"].forbidden_ops, uses_triton)
    check_rules(report, uses_triton, grad_o is not None, case.describe())
    return report, grader_value


def run_probe(student, case: AttentionCase, q, k, v, grad_o=None, uses_triton: bool = False) -> dict:
    """The probe's report on the student's module, after the rules are checked (see check_rules)."""
    return _probe_beside(student, case, q, k, v, grad_o, uses_triton, None)[0]


def probe_and_expect(student, reference, case: AttentionCase, q, k, v, grad_o=None,
                     uses_triton: bool = False) -> tuple[dict, "Expected"]:
    """The probe's report on the student's module and what the case must give, computed at the same time."""
    return _probe_beside(student, case, q, k, v, grad_o, uses_triton,
                         lambda: reference.computed(expected, case, q, k, v, grad_o))


def call_and_expect(student, reference, case: AttentionCase, q, k, v) -> tuple:
    """flash_attention(q, k, v) of the student's module, is_causal left at its default (False, pinned), and what it
    must give."""
    with student.describing(case.describe()):
        reply, want = student.call_beside(lambda: reference.computed(expected, case, q, k, v), "flash_attention",
                                          q, k, v)
    return reply["value"], want


@dataclass
class Expected:
    """What a case must give: the plain reference at float64 and the fast reference at the case's dtype (its probe
    report); the gradients only when an upstream dO was given."""

    output64: torch.Tensor
    lse64: torch.Tensor
    at_dtype: dict
    # max_ij s * (|q_i| . |k_j|): a float32 score, and so L, is exact to a few ulps of this, however it is summed.
    score_scale: float = 0.0
    grads64: tuple[torch.Tensor, ...] | None = None
    term_scales: tuple[float, float, float] | None = None  # of dq, dk, dv: see gradient_term_scales


def expected(reference, case: AttentionCase, q, k, v, grad_o=None) -> Expected:
    """Called through reference.computed: the probe looks into the reference's autograd node (grader.session.budget)."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    output64, lse64 = reference.flash_attention_torch(q64, k64, v64, case.is_causal)
    want = Expected(output64.detach(), lse64.detach(), probe(reference, q, k, v, case.is_causal, grad_o))
    want.score_scale = float((q64.detach().abs() @ k64.detach().abs().transpose(-1, -2)).max()) / math.sqrt(q.shape[-1])
    if grad_o is not None:
        output64.backward(grad_o.double())
        want.grads64 = (q64.grad, k64.grad, v64.grad)
        want.term_scales = gradient_term_scales(q, k, v, grad_o, case.is_causal)
    return want


def gradient_term_scales(q, k, v, grad_o, is_causal: bool, window: int | None = None) -> tuple[float, float, float]:
    """The size of the largest terms each gradient sums, whatever the order of summation.

    dQ_i = s sum_j P_ij (dP_ij - D_i) k_j with dP_ij = dO_i . v_j and D_i = dO_i . O_i (s = 1/sqrt(head_dim)): where
    dP_ij and D_i nearly cancel (one key holding all the attention, a single key), a float computation is left with
    rounding errors of about |P_ij| (|dO_i| . |v_j| + |dO_i| . |O_i|) each, far above the result itself. dK is the
    same sum over queries; dV = sum_i P_ij dO_i. A gradient may err by a few ulps of these term sizes.
    """
    q, k, v, grad_o = (t.detach().double() for t in (q, k, v, grad_o))
    seq, head_dim = q.shape[-2:]
    scale = 1.0 / math.sqrt(head_dim)
    scores = q @ k.transpose(-1, -2) * scale
    if is_causal:
        hidden = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        if window is not None:  # and keys j <= i - window
            hidden |= torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril(-window)
        scores = scores.masked_fill(hidden, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    output = probs @ v
    bound = probs * (grad_o.abs() @ v.abs().transpose(-1, -2) + (grad_o.abs() * output.abs()).sum(-1, keepdim=True))
    return (
        float((scale * bound @ k.abs()).max()),
        float((scale * bound.transpose(-1, -2) @ q.abs()).max()),
        float((probs.transpose(-1, -2) @ grad_o.abs()).max()),
    )


def check_output(actual, want: Expected, error_multiple: float, floor_ulps: float, context: str,
                 function: str = "flash_attention") -> None:
    assert_close(actual, want.output64, want.at_dtype["output"], what=f"output o of {function}",
                 context=context, multiple=error_multiple, floor_ulps=floor_ulps)


def check_lse(report: dict, want: Expected, error_multiple: float, floor_ulps: float, context: str,
              cls: str = "FlashAttentionFunction") -> None:
    """L, read from the fifth tensor the autograd.Function `cls` saved in forward, against logsumexp at float64."""
    function_node(report, context, cls)
    if report["lse"] is None:
        raise WrongAnswer(
            f"{cls} saved {describe_saved(report)}; the fifth of ctx.save_for_backward(q, k, v, o, "
            f"L) must be the logsumexp L ({context})"
        )
    # A row's L can be far smaller than its scores (scores of both signs, or a few negative ones): the floor is in
    # ulps of the larger of the two.
    lse_scale = float(want.lse64.abs().max())
    floor_ulps = floor_ulps * max(1.0, want.score_scale / lse_scale) if lse_scale > 0 else floor_ulps
    assert_close(report["lse"], want.lse64, want.at_dtype["lse"], what="logsumexp L (the fifth saved tensor)",
                 context=context, multiple=error_multiple, floor_ulps=floor_ulps)


def function_node(report: dict, context: str, cls: str = "FlashAttentionFunction") -> None:
    count = report["function_nodes"]
    if count != 1:
        found = "none" if count == 0 else f"{count}"
        raise WrongAnswer(
            f"the output must come from one {cls}.apply, whose autograd node ({cls}Backward) holds the saved "
            f"tensors; its graph has {found} ({context})"
        )


def check_gradients(report: dict, want: Expected, error_multiple: float, floor_ulps: float, context: str) -> None:
    if report["grads"] is None:
        raise WrongAnswer(f"the output does not require grad for inputs that do ({context})")
    for name, actual, exact, at_dtype, term_scale in zip(
        ("q", "k", "v"), report["grads"], want.grads64, want.at_dtype["grads"], want.term_scales
    ):
        what = f"gradient of {name}"
        if actual is None:
            raise WrongAnswer(f"{what}: {name} received no gradient ({context})")
        check_gradient(actual, exact, at_dtype, term_scale, error_multiple, floor_ulps, what, context)


def check_gradient(actual, exact, at_dtype, term_scale: float, error_multiple: float, floor_ulps: float, what: str,
                   context: str) -> None:
    """assert_close with its floor at floor_ulps ulps of the larger of the result and its terms (see
    gradient_term_scales); where the exact gradient is zero, only the floor."""
    result_scale = float(exact.abs().max())
    if result_scale > 0:
        assert_close(actual, exact, at_dtype, what=what, context=context, multiple=error_multiple,
                     floor_ulps=floor_ulps * max(1.0, term_scale / result_scale))
        return
    check_tensor_form(actual, at_dtype, what, context)
    floor = floor_ulps * torch.finfo(at_dtype.dtype).eps * term_scale
    error = float((actual.detach().double().cpu() - exact.cpu()).abs().max())
    if not error <= floor:
        raise WrongAnswer(f"{what}: expected exactly 0 (the output does not depend on it here), got an error of "
                          f"{error:.3g}; allowed {floor:.3g} ({context})")


def check_no_score_matrix(report: dict, seq: int, context: str, cls: str = "FlashAttentionFunction") -> None:
    """The autograd.Function `cls` saves exactly (q, k, v, o, L), keeps no tensor on ctx, and no n x n tensor is
    built."""
    function_node(report, context, cls)
    square = [shape for shape, _ in report["saved"] if is_square(shape, seq)]
    if square:
        raise WrongAnswer(
            f"{cls} saved a tensor of shape {square[0]} for backward: an n x n matrix (seq = {seq}) "
            f"that FlashAttention never stores; save only (q, k, v, o, L) ({context})"
        )
    if len(report["saved"]) != 5:
        raise WrongAnswer(f"{cls} saved {describe_saved(report)}; it must save exactly "
                          f"(q, k, v, o, L) ({context})")
    if report["ctx_tensors"]:
        raise WrongAnswer(
            f"{cls} kept tensors on ctx outside save_for_backward ({', '.join(report['ctx_tensors'])})"
            f"; it must save exactly (q, k, v, o, L) with ctx.save_for_backward ({context})"
        )
    if report["square_tensors"]:
        raise WrongAnswer(
            f"the call built tensors spanning the whole sequence (seq = {seq}) along two dimensions, or along "
            f"one beside a tile of {TORCH_TILE_SIZE}, in its forward or backward: "
            f"{'; '.join(report['square_tensors'])}; scores, probabilities and masks must stay in TILE_SIZE x "
            f"TILE_SIZE blocks ({context})"
        )


def check_blocks_bounded(report: dict, seq: int, context: str) -> None:
    """No block (a Triton tensor of two or more dimensions) in any kernel the call launched has a dimension longer
    than TRITON_MAX_BLOCK; seq exceeds it, so a block of the whole sequence fails."""
    if report["widest_block"] is None:
        return
    kernel, shape = report["widest_block"]
    if max(shape) > TRITON_MAX_BLOCK:
        raise WrongAnswer(
            f"Triton kernel `{kernel}` holds a block of shape {tuple(shape)}, longer than {TRITON_MAX_BLOCK} along a "
            f"dimension (seq = {seq}): FlashAttention streams the sequence in tiles of at most {TRITON_MAX_BLOCK} "
            f"queries and {TRITON_MAX_BLOCK} keys, and no block of any kernel may exceed {TRITON_MAX_BLOCK} along any "
            f"dimension ({context})"
        )


def describe_saved(report: dict) -> str:
    saved = report["saved"]
    listing = ", ".join(f"{tuple(shape)} {dtype}" for shape, dtype in saved)
    return f"{len(saved)} tensor{'' if len(saved) == 1 else 's'}" + (f" ({listing})" if saved else "")


def check_rules(report: dict, uses_triton: bool, backward: bool, context: str,
                function: str = "flash_attention") -> None:
    """No forbidden operator; Triton kernels launched by the forward and the backward where the problem says so."""
    if report["forbidden"]:
        raise RuleViolation(f"{function} called {', '.join(report['forbidden'])}: this problem is to "
                            f"reimplement attention ({context})")
    if uses_triton and not report["forward_launches"]:
        raise RuleViolation(f"{function} launched no Triton kernel in its forward ({context})")
    if uses_triton and backward and not report["backward_launches"]:
        raise RuleViolation(f"the backward of {function} launched no Triton kernel: it must be yours, in "
                            f"Triton ({context})")
    if report["computed"]:
        raise RuleViolation(f"{function} computed with {', '.join(report['computed'])} outside a Triton kernel: "
                            f"torch may only allocate, view and copy tensors here ({context})")
    if uses_triton:
        check_triton_traffic(report, function, context)


# --- invalid arguments: one fault each --------------------------------------------------------------------------


def _ones(shapes, dtypes=(torch.float32,) * 3):
    return lambda device: tuple(torch.ones(s, dtype=d, device=device) for s, d in zip(shapes, dtypes))


INVALID = [
    pytest.param(_ones([(1, 2, 5, 16), (1, 2, 7, 16), (1, 2, 7, 16)]), "ValueError", id="key-length-differs"),
    pytest.param(_ones([(1, 2, 5, 16), (1, 2, 5, 16), (1, 2, 7, 16)]), "ValueError", id="value-length-differs"),
    pytest.param(_ones([(1, 2, 5, 16), (1, 3, 5, 16), (1, 3, 5, 16)]), "ValueError", id="heads-differ"),
    pytest.param(_ones([(1, 2, 5, 16), (1, 2, 5, 16), (1, 2, 5, 32)]), "ValueError", id="value-dim-differs"),
    pytest.param(_ones([(5, 16)] * 3), "ValueError", id="2-D"),
    pytest.param(_ones([(1, 1, 2, 5, 16)] * 3), "ValueError", id="5-D"),
    pytest.param(_ones([(2, 5, 24)] * 3), "ValueError", id="head_dim=24"),
    pytest.param(_ones([(2, 5, 8)] * 3), "ValueError", id="head_dim=8"),
    pytest.param(_ones([(2, 5, 144)] * 3), "ValueError", id="head_dim=144"),
    pytest.param(_ones([(2, 0, 16)] * 3), "ValueError", id="seq=0"),
    pytest.param(_ones([(2, 5, 16)] * 3, [torch.float64] * 3), "TypeError", id="float64"),
    pytest.param(_ones([(2, 5, 16)] * 3, [torch.int32] * 3), "TypeError", id="int32"),
    pytest.param(_ones([(2, 5, 16)] * 3, [torch.float32, torch.float16, torch.float32]), "TypeError",
                 id="mixed-dtypes"),
]


def check_raises(student, make_inputs, expected_error: str) -> None:
    """flash_attention raises `expected_error` (a class name) for the inputs make_inputs(device) returns."""
    q, k, v = make_inputs(current().device)
    assert_raises(
        student.raises("flash_attention", q, k, v, False), expected_error,
        f"flash_attention(q, k, v) for q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, "
        f"v {tuple(v.shape)} {v.dtype}",
    )
