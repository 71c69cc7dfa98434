"""Grading moe.moe_layer: a full MoE feed-forward layer (routed SwiGLU experts, shared experts, top-k routing).

The output and the gradients of all eight inputs are measured against the plain reference (every expert on every
token) in float64, allowing a multiple of the fast reference's own error at the test dtype. Routing is discrete:
tokens whose top-(k+1) probabilities are nearly tied are dropped from the random inputs (moe.router's
separated_rows), so that every correct float32 computation chooses the same experts. Skewed routings leave experts
empty and loads uneven. That the dispatch is batched per expert (no Python loop over tokens) is checked by counting
the torch operations of one call at two token counts: it must not grow with T.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from assignment.registry import BY_ID
from grader.checks.compare import assert_raises, inputs_if_small
from grader.checks.marks import gpu_only
from grader.checks.outcomes import WrongAnswer
from grader.checks.profiles import examples
from grader.checks.strategies import LAYOUTS, dims, size_scale
from grader.moe.routing_checks import compare_floating, dtype_name, laid_out, router_term_scales, separated_rows
from grader.moe.speed_cases import SPEEDS
from grader.session.context import current
from grader.speed.grading import grade_speed

PROBLEM = BY_ID["moe.moe_layer"]
INPUTS = ("x_TD", "router_weight_ED", "gate_proj_EHD", "up_proj_EHD", "down_proj_EDH", "shared_gate_proj_SFD",
          "shared_up_proj_SFD", "shared_down_proj_SDF")
# Standard deviations of the router logits. The layer is not a test of routing precision (moe.router is): moderate
# logits keep the gates' float32 rounding below the experts' own.
LOGIT_SCALES = (0.5, 1.0, 2.0)
# A dead expert's router logits are lowered by this much: it is chosen only when fewer than k experts are alive.
DEAD_OFFSET = 40.0
# The dispatch check: one call at BATCHED_TOKENS[0] tokens and one at BATCHED_TOKENS[1]; the second may issue at
# most OPERATION_GROWTH times as many torch operations (a loop over tokens issues about 64 times as many).
BATCHED_TOKENS = (8, 512)
OPERATION_GROWTH = 4


@dataclass(frozen=True)
class LayerCase:
    """One layer and its inputs, built deterministically from the fields: the description is a recipe.

    x and the projections are Gaussian, the projections scaled by 1 / sqrt(fan-in); the router is Gaussian scaled so
    that the logits have standard deviation logit_scale. With routing="skewed", feature 0 of x is 1 for every token
    and the router's column 0 gives each expert a popularity offset: a third of the experts (at least one) are
    alive with offsets in [0, 3), the others dead (offset -DEAD_OFFSET), so live experts get uneven loads and dead
    ones none. Of twice `tokens` drawn tokens, the first `tokens` whose routing is not nearly tied are kept.
    """

    tokens: int
    width: int
    hidden: int
    experts: int
    k: int
    shared: int
    shared_hidden: int
    normalize_topk: bool
    routing: str = "normal"
    dtype: torch.dtype = torch.float32
    x_layout: str = "contiguous"
    logit_scale: float = 1.0
    seed: int = 0

    def exact_inputs(self) -> list[torch.Tensor]:
        """The eight tensors in float64 on the CPU, holding exactly the values the student receives."""
        generator = torch.Generator().manual_seed(self.seed)

        def normal(*shape, scale=1.0):
            return torch.randn(shape, generator=generator, dtype=torch.float64) * scale

        x_TD = normal(2 * self.tokens, self.width)
        router_ED = normal(self.experts, self.width, scale=self.logit_scale / self.width**0.5)
        if self.routing == "skewed":
            x_TD[:, 0] = 1.0
            alive = torch.randperm(self.experts, generator=generator)[: max(1, self.experts // 3)]
            offset_E = torch.full((self.experts,), -DEAD_OFFSET, dtype=torch.float64)
            offset_E[alive] = torch.rand(alive.numel(), generator=generator, dtype=torch.float64) * 3
            router_ED[:, 0] = offset_E
        tensors = [
            x_TD, router_ED,
            normal(self.experts, self.hidden, self.width, scale=self.width**-0.5),
            normal(self.experts, self.hidden, self.width, scale=self.width**-0.5),
            normal(self.experts, self.width, self.hidden, scale=self.hidden**-0.5),
            normal(self.shared, self.shared_hidden, self.width, scale=self.width**-0.5),
            normal(self.shared, self.shared_hidden, self.width, scale=self.width**-0.5),
            normal(self.shared, self.width, self.shared_hidden, scale=self.shared_hidden**-0.5),
        ]
        # Routing is computed from the float32 router and the case's x, so ties are judged on those values.
        tensors = [t.to(self.dtype if i != 1 else torch.float32).double() for i, t in enumerate(tensors)]
        tensors[0] = tensors[0][separated_rows(tensors[0], tensors[1], self.k)][: self.tokens]
        return tensors

    def inputs(self) -> list[torch.Tensor]:
        exact = self.exact_inputs()
        assume(exact[0].shape[0] > 0)
        device = current().device
        tensors = [t.to(self.dtype if i != 1 else torch.float32).to(device) for i, t in enumerate(exact)]
        tensors[0] = laid_out(tensors[0], self.x_layout)
        return tensors

    def upstream(self, x_TD: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + 1)
        return torch.randn(x_TD.shape, generator=generator, dtype=torch.float64).to(self.dtype).to(x_TD.device)

    def describe(self, x_TD: torch.Tensor) -> str:
        return (
            f"T={x_TD.shape[0]}, D={self.width}, H={self.hidden}, E={self.experts}, k={self.k}, S={self.shared}, "
            f"F={self.shared_hidden}, normalize_topk={self.normalize_topk}, routing={self.routing}, logit scale "
            f"{self.logit_scale:g}, {dtype_name(self.dtype)}, x_TD {self.x_layout} (of {2 * self.tokens} tokens "
            f"drawn, the first {self.tokens} not nearly tied), router float32, seed={self.seed}"
        ) + inputs_if_small(x_TD=x_TD)


@st.composite
def layer_cases(draw, routing: str = "normal", dtype: torch.dtype = torch.float32, edge: bool = False) -> LayerCase:
    """Layers of up to 64 tokens at ci size; with edge, the extremes: T of 1 to 3, k = 1 or k = E, E = 1 likely,
    no shared expert or one of hidden size 1."""
    scale = size_scale()
    # The expert weights grow as E * H * D. At a GPU's grading scale (32) one case's weights were 1.2 GB, drawn in
    # float64 on the grader's CPU and sent to the worker, and the problem took 489 s of a 6-lane grading run on an
    # H200. Width and hidden stop at 8 times the ci sizes, where every tile boundary the dims favour is reachable.
    weight_scale = min(scale, 8)
    if edge:
        experts = draw(st.sampled_from((1, 2, 3, 8)))
        k = draw(st.sampled_from((1, experts)))
        tokens = draw(st.integers(1, 3))
        shared = draw(st.integers(0, 1))
    else:
        experts = draw(dims(16 * min(scale, 4), tiles=(8, 16, 32, 64)))
        k = draw(st.integers(1, min(experts, 8)))
        tokens = draw(dims(64 * scale))
        shared = draw(st.integers(0, 2))
    return LayerCase(
        tokens=tokens,
        width=draw(dims(48 * weight_scale)),
        hidden=draw(dims(32 * weight_scale)),
        experts=experts,
        k=k,
        shared=shared,
        shared_hidden=draw(dims(24 * scale)),
        normalize_topk=draw(st.booleans()),
        routing=routing,
        dtype=dtype,
        x_layout=draw(st.sampled_from(LAYOUTS)),
        logit_scale=draw(st.sampled_from(LOGIT_SCALES)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def reference_gradients(layer, tensors: list[torch.Tensor], case: LayerCase, upstream: torch.Tensor) -> list:
    tensors = [t.detach().requires_grad_(True) for t in tensors]
    layer(*tensors, case.k, case.normalize_topk).backward(upstream.to(tensors[0].dtype))
    return [t.grad for t in tensors]


def gate_path_term_scales(exact: list[torch.Tensor], case: LayerCase, upstream: torch.Tensor) -> tuple[float, float]:
    """How large the terms are that the backward pass through the gates sums into grad x and grad router.

    The upstream gradient of gate (t, j) is G_tj = upstream_t . expert_{e_tj}(x_t); with renormalisation it is
    divided by the chosen probabilities' sum. Every float32 evaluation is uncertain by a few ulps of
    sum_j |G_tj| times the logits' own scale (1 + max_e sum_d |x_d w_ed| + |lse|, as in moe.router). Where those
    terms cancel (k = 1 with renormalised gates: the gate is exactly 1 and its gradient exactly 0), the result
    is that rounding, so the floor scales with them rather than with the result.
    """
    x_TD, router_ED, gate_EHD, up_EHD, down_EDH = exact[:5]
    logits_TE = x_TD @ router_ED.T
    probs_TE = torch.softmax(logits_TE, dim=-1)
    chosen_TK = probs_TE.sort(dim=-1, descending=True, stable=True).indices[:, : case.k]
    hidden_ETH = F.silu(torch.einsum("td,ehd->eth", x_TD, gate_EHD)) * torch.einsum("td,ehd->eth", x_TD, up_EHD)
    out_ETD = torch.einsum("eth,edh->etd", hidden_ETH, down_EDH)
    out_TKD = out_ETD[chosen_TK, torch.arange(x_TD.shape[0], device=x_TD.device)[:, None]]
    per_token_T = (out_TKD * upstream.double()[:, None, :]).sum(dim=-1).abs().sum(dim=-1)
    if case.normalize_topk:
        per_token_T = per_token_T / probs_TE.gather(1, chosen_TK).sum(dim=-1)
    lse_T = torch.logsumexp(logits_TE, dim=-1)
    return router_term_scales(
        per_token_T * (1 + (x_TD.abs() @ router_ED.abs().T).amax(dim=-1) + lse_T.abs()), x_TD, router_ED)


class Layer:
    """The student's layer on one case, the fast reference's at the case's dtype and the plain one's in float64."""

    def __init__(self, student, reference, case: LayerCase):
        self.student, self.reference, self.case = student, reference, case
        self.tensors = case.inputs()
        # float64 on the case's device: the plain reference runs every expert on every token, which a GPU does fast.
        self.exact_tensors = [t.double() for t in self.tensors]
        self.context = case.describe(self.tensors[0])

    def check_output(self) -> None:
        with self.student.describing(self.context):
            actual = self.student.call("moe_layer", *self.tensors, self.case.k, self.case.normalize_topk)
        with torch.no_grad():
            at_dtype = self.reference.moe_layer(*self.tensors, self.case.k, self.case.normalize_topk)
            exact = self.reference.moe_layer_torch(*self.exact_tensors, self.case.k, self.case.normalize_topk)
        compare_floating(actual, exact, at_dtype, 0.0, PROBLEM, "moe_layer output y_TD", self.context)

    def check_gradients(self) -> None:
        upstream = self.case.upstream(self.tensors[0])
        grad = {"inputs": list(range(len(INPUTS))), "upstream": [upstream]}
        with self.student.describing(self.context):
            actual = self.student.call_traced("moe_layer", *self.tensors, self.case.k, self.case.normalize_topk,
                                              grad=grad)["grads"]
        exact = reference_gradients(self.reference.moe_layer_torch, self.exact_tensors, self.case, upstream)
        at_dtype = reference_gradients(self.reference.moe_layer, self.tensors, self.case, upstream)
        x_scale, router_scale = gate_path_term_scales(self.exact_tensors, self.case, upstream)
        floor_scales = {"x_TD": x_scale, "router_weight_ED": router_scale}
        for index, name in enumerate(INPUTS):
            if self.tensors[index].numel() == 0:
                continue  # no shared expert (S = 0): a gradient with no values, or none at all
            what = f"gradient of {name}"
            if actual[index] is None:
                raise WrongAnswer(f"{what}: {name} received no gradient ({self.context})")
            compare_floating(actual[index], exact[index], at_dtype[index], floor_scales.get(name, 0.0), PROBLEM,
                             what, self.context)


@examples(PROBLEM)
@given(case=layer_cases())
def test_output(student, reference, case):
    Layer(student, reference, case).check_output()


@examples(PROBLEM)
@given(case=layer_cases())
def test_gradients(student, reference, case):
    Layer(student, reference, case).check_gradients()


@examples(PROBLEM)
@given(case=layer_cases(routing="skewed"))
def test_uneven_and_empty_experts(student, reference, case):
    """Most experts receive no token and the others uneven loads: their outputs, and zero gradients for the idle."""
    layer = Layer(student, reference, case)
    layer.check_output()
    layer.check_gradients()


@examples(PROBLEM, 0.5)
@given(case=layer_cases(edge=True))
def test_edge_sizes(student, reference, case):
    layer = Layer(student, reference, case)
    layer.check_output()
    layer.check_gradients()


@gpu_only
@examples(PROBLEM)
@given(case=layer_cases(dtype=torch.bfloat16))
def test_bf16(student, reference, case):
    layer = Layer(student, reference, case)
    layer.check_output()
    layer.check_gradients()


def balanced_inputs(tokens: int, device: torch.device, experts: int = 4) -> list[torch.Tensor]:
    """`experts` experts, one shared expert, width 8 and expert hidden size 4: token t prefers expert t mod E, then
    t + 1 mod E, by clear margins (k = 1 or 2), so every expert receives tokens at any T >= E."""
    width, hidden = 8, 4
    generator = torch.Generator().manual_seed(tokens)
    x_TD = torch.randn(tokens, width, generator=generator)
    x_TD[:, :experts] = 0.0
    token_T = torch.arange(tokens)
    x_TD[token_T, token_T % experts] = 2.0
    x_TD[token_T, (token_T + 1) % experts] = 1.0
    router_ED = torch.cat([3 * torch.eye(experts), torch.zeros(experts, width - experts)], dim=1)
    weights = [torch.randn(shape, generator=generator) / 4 for shape in
               ((experts, hidden, width), (experts, hidden, width), (experts, width, hidden),
                (1, hidden, width), (1, hidden, width), (1, width, hidden))]
    return [t.to(device) for t in (x_TD, router_ED, *weights)]


class OperationCounter(TorchDispatchMode):
    """Counts every aten operation dispatched while active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_operations(module, device: str) -> list[int]:
    """Run in the student's worker: the torch operations of one forward call at each of BATCHED_TOKENS."""
    counts = []
    for tokens in BATCHED_TOKENS:
        tensors = balanced_inputs(tokens, torch.device(device))
        with OperationCounter() as counter:
            module.moe_layer(*tensors, 2, True)
        counts.append(counter.count)
    return counts


def check_balanced_output(student, reference, tensors: list[torch.Tensor], k: int, case: str) -> None:
    """The student's moe_layer output on balanced inputs, against the reference's."""
    with student.describing(case):
        actual = student.call("moe_layer", *tensors, k, True)
    with torch.no_grad():
        exact = reference.moe_layer_torch(*(t.double() for t in tensors), k, True)
        at_dtype = reference.moe_layer(*tensors, k, True)
    compare_floating(actual, exact, at_dtype, 0.0, PROBLEM, "moe_layer output y_TD", case)


# The work check: T tokens, E experts of hidden size H over width D, k routed and S shared experts per token. A
# sparse layer multiplies T x D by E x D for the router and then runs each token through k + S experts (gate and up
# D -> H, down H -> D: 6 H D FLOPs a token); running every token through all E experts does E + S of them instead.
SPARSE_TOKENS, SPARSE_EXPERTS, SPARSE_K, SPARSE_SHARED, SPARSE_WIDTH, SPARSE_HIDDEN = 256, 8, 1, 1, 8, 4
# Matrix-product FLOPs allowed, as a multiple of the sparse count (dense computation is 3.6 times it here).
FLOP_ALLOWANCE = 1.5


def matmul_flops(experts_per_token: int) -> int:
    t, d, h = SPARSE_TOKENS, SPARSE_WIDTH, SPARSE_HIDDEN
    return 2 * t * SPARSE_EXPERTS * d + experts_per_token * t * 6 * h * d


def count_flops(module, device: str) -> int:
    """Run in the student's worker: the matrix-product FLOPs (torch's flop counter) of one forward call."""
    from torch.utils.flop_counter import FlopCounterMode

    tensors = balanced_inputs(SPARSE_TOKENS, torch.device(device), experts=SPARSE_EXPERTS)
    with FlopCounterMode(display=False) as counter:
        module.moe_layer(*tensors, SPARSE_K, True)
    return int(counter.get_total_flops())


def test_sparse_compute(student, reference):
    """Each token goes through its k routed experts (and the shared ones) only: the matrix products of one call,
    counted by torch's flop counter in the worker, stay within FLOP_ALLOWANCE times those of a sparse layer."""
    device = current().device
    case = (f"T={SPARSE_TOKENS}, E={SPARSE_EXPERTS}, k={SPARSE_K}, {SPARSE_SHARED} shared expert, "
            f"D={SPARSE_WIDTH}, H={SPARSE_HIDDEN}, every expert receiving tokens")
    # The outputs must be right, or the count means nothing.
    check_balanced_output(student, reference, balanced_inputs(SPARSE_TOKENS, device, experts=SPARSE_EXPERTS),
                          SPARSE_K, case)
    with student.describing(f"FLOP count at {case}"):
        flops = student.run_program(f"{__name__}:count_flops", str(device))
    sparse, dense = matmul_flops(SPARSE_K + SPARSE_SHARED), matmul_flops(SPARSE_EXPERTS + SPARSE_SHARED)
    if flops > FLOP_ALLOWANCE * sparse:
        raise WrongAnswer(
            f"moe_layer's matrix products took {flops} FLOPs ({case}): a sparse layer needs {sparse} (the router, "
            f"then each token through its {SPARSE_K} routed and {SPARSE_SHARED} shared expert), running every token "
            f"through every expert {dense}; at most {FLOP_ALLOWANCE:g} x {sparse} is allowed"
        )


def test_batched_dispatch(student, reference):
    """No Python loop over tokens: from T = 8 to T = 512 (every expert busy at both), the number of operations
    must stay about the same."""
    device = current().device
    for tokens in BATCHED_TOKENS:  # the outputs must be right, or the count means nothing
        case = f"four experts, k=2, one shared expert, T={tokens}, every expert receiving tokens"
        check_balanced_output(student, reference, balanced_inputs(tokens, device), 2, case)
    with student.describing(f"operation count at T={BATCHED_TOKENS}"):
        small, large = student.run_program(f"{__name__}:count_operations", str(device))
    if large > OPERATION_GROWTH * small:
        raise WrongAnswer(
            f"moe_layer issued {small} torch operations at T={BATCHED_TOKENS[0]} but {large} at "
            f"T={BATCHED_TOKENS[1]} (four experts, k=2, one shared expert): the work grows with the number of "
            f"tokens, so it is not batched per expert (a Python loop over tokens?); at most {OPERATION_GROWTH}x "
            f"is allowed"
        )


def _tensors(x=(3, 4), router=(5, 4), gate=(5, 2, 4), up=(5, 2, 4), down=(5, 4, 2), shared_gate=(1, 3, 4),
             shared_up=(1, 3, 4), shared_down=(1, 4, 3), dtype=torch.float32, router_dtype=torch.float32,
             down_dtype=None):
    shapes = (x, router, gate, up, down, shared_gate, shared_up, shared_down)
    dtypes = (dtype, router_dtype, dtype, dtype, down_dtype or dtype, dtype, dtype, dtype)
    return lambda device: [torch.ones(shape, dtype=d, device=device) for shape, d in zip(shapes, dtypes)]


INVALID = [
    pytest.param(_tensors(), 0, "ValueError", id="k=0"),
    pytest.param(_tensors(), 6, "ValueError", id="k>E"),
    pytest.param(_tensors(x=(0, 4)), 2, "ValueError", id="T=0"),
    pytest.param(_tensors(x=(4,)), 2, "ValueError", id="1-D-x"),
    pytest.param(_tensors(x=(3, 5)), 2, "ValueError", id="D-mismatch"),
    pytest.param(_tensors(gate=(4, 2, 4)), 2, "ValueError", id="E-mismatch"),
    pytest.param(_tensors(down=(5, 4, 3)), 2, "ValueError", id="H-mismatch"),
    pytest.param(_tensors(shared_down=(2, 4, 3)), 2, "ValueError", id="S-mismatch"),
    pytest.param(_tensors(gate=(5, 8)), 2, "ValueError", id="2-D-projection"),
    pytest.param(_tensors(dtype=torch.int64, router_dtype=torch.int64), 2, "TypeError", id="int64"),
    pytest.param(_tensors(down_dtype=torch.float64), 2, "TypeError", id="dtype-mismatch"),
]


@pytest.mark.parametrize("make, k, expected_error", INVALID)
def test_invalid_arguments(student, make, k, expected_error):
    tensors = make(current().device)
    shapes = ", ".join(f"{name} {tuple(t.shape)} {dtype_name(t.dtype)}" for name, t in zip(INPUTS, tensors))
    assert_raises(student.raises("moe_layer", *tensors, k, True), expected_error, f"moe_layer({shapes}, k={k})")


# --- speed -------------------------------------------------------------------------------------------------------


@gpu_only
@pytest.mark.parametrize("case", PROBLEM.speed.cases(), ids=str)
def test_speed(student, reference, partial_credit, case):
    """Forward and backward at (T, D, H, E, k, S); the baseline ("torch" in the message) is the idealised grouped
    GEMM of grader.moe.speed_cases."""
    grade_speed(SPEEDS[PROBLEM.id], student, reference, case, PROBLEM.speed, partial_credit)
