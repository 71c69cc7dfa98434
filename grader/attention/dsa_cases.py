"""What the DeepSeek sparse attention problem grades with: its cases (indexer inputs, score matrices for the top-k,
selections for the attention), the probe that watches `sparse_attention` run inside the worker, the float64 oracle,
and the two measures of the attention's work.

Work is measured as for the sliding window, both inside the worker (evidence against honest mistakes: code that
defeats the hooks or the clock is not caught here): under Triton's interpreter, the lanes of every load of forward
and backward at three lengths with topk fixed; on a GPU, their time at two lengths four times apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.attention import work_growth
from grader.checks.outcomes import WrongAnswer
from grader.checks.strategies import dims, size_scale
from grader.kernels.attention_cases import (
    REGIMES,
    SHARP_FACTOR,
    Expected,
    check_rules,
    describe_saved,
    function_node,
    head_dims,
    is_square,
    observe,
)
from grader.session.context import current

PROBLEM = BY_ID["attention.sparse_dsa"]
FUNCTION = "sparse_attention"
FUNCTION_CLASS = "SparseAttentionFunction"
# topk at and around the reference's interpreter block (16 keys) and the GPU's (32 and 64).
EDGE_TOPKS = (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65)
# causal: each query's top-k of random scores (what select_topk gives); any: keys anywhere in the sequence, in any
# order, with -1 in any slot; shared: every query selects the same keys (every dK and dV row sums many queries);
# single: one key per query, the rest -1.
SELECTIONS = ("causal", "any", "shared", "single")
# Interpreter work: lengths 32 apart, topk inside the first step. Short, because a kernel that walks every key runs
# slowly under the interpreter, and one call measures all three lengths within its time limit.
WORK_LENGTHS = (32, 64, 96)
WORK_TOPK = 16
# The next 32 queries may cost this much more than the previous 32 (a kernel that loads only the selected keys does
# 1.0; one that walks every earlier key in blocks of 16 and masks does about 1.4).
WORK_GROWTH_LIMIT = 1.2
# GPU time: forward and backward at T and 4 T with topk 256; linear work takes 4x, dense causal work 16x.
TIME_LENGTHS = (4096, 16384)
TIME_TOPK = 256
TIME_RATIO_LIMIT = 6.0


def _describe_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- the indexer ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexerCase:
    batch: int
    seq: int
    index_heads: int
    index_dim: int
    dtype: torch.dtype
    strided: bool = False  # q_idx a view of [batch, index_heads, seq, index_dim]
    integers: bool = False  # small integers: every product and sum exact
    seed: int = 0

    def exact_inputs(self) -> tuple[torch.Tensor, ...]:
        """q_idx, k_idx, weights in float64 on the CPU, holding exactly the case's values."""
        generator = torch.Generator().manual_seed(self.seed)
        shapes = ((self.batch, self.seq, self.index_heads, self.index_dim), (self.batch, self.seq, self.index_dim),
                  (self.batch, self.seq, self.index_heads))
        if self.integers:
            tensors = [torch.randint(-2, 3, s, generator=generator).double() for s in shapes]
        else:
            tensors = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
        return tuple(t.to(self.dtype).double() for t in tensors)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        q_idx, k_idx, weights = (t.to(self.dtype).to(current().device) for t in self.exact_inputs())
        if self.strided:
            q_idx = q_idx.transpose(1, 2).contiguous().transpose(1, 2)
        return q_idx, k_idx, weights

    def describe(self) -> str:
        return (f"q_idx {(self.batch, self.seq, self.index_heads, self.index_dim)} [batch, seq, index_heads, "
                f"index_dim]{' (a transposed view)' if self.strided else ''}, dtype={_describe_dtype(self.dtype)}, "
                f"values={'integers' if self.integers else 'normal'}, seed={self.seed}")


# The indexer's index_dim is padded the same way: 48, 80 and 96 in every profile.
PADDED_INDEX_DIMS = tuple(IndexerCase(batch=1, seq=21, index_heads=2, index_dim=index_dim, dtype=torch.float32,
                                      strided=index_dim == 80, seed=index_dim) for index_dim in (48, 80, 96))


@st.composite
def indexer_cases(draw, dtypes: tuple[torch.dtype, ...]) -> IndexerCase:
    return IndexerCase(
        batch=draw(st.integers(1, 3)),
        seq=draw(dims(40 * size_scale())),
        index_heads=draw(st.integers(1, 4 * size_scale())),
        index_dim=draw(st.sampled_from(head_dims())),
        dtype=draw(st.sampled_from(dtypes)),
        strided=draw(st.booleans()),
        integers=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# --- the top-k ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopkCase:
    batch: int
    seq: int
    topk: int
    values: str = "ties"  # ties: integers from -2 to 2; normal; equal: every score 1.0
    seed: int = 0

    def scores(self, device: torch.device) -> torch.Tensor:
        """float32 [batch, seq, seq]; above the diagonal, values select_topk must ignore: huge, +inf and normal."""
        generator = torch.Generator().manual_seed(self.seed)
        shape = (self.batch, self.seq, self.seq)
        if self.values == "ties":
            scores = torch.randint(-2, 3, shape, generator=generator).float()
        elif self.values == "equal":
            scores = torch.ones(shape)
        else:
            scores = torch.randn(shape, generator=generator)
        future = torch.ones(self.seq, self.seq, dtype=torch.bool).triu(1)
        junk = torch.tensor([math.inf, 3.0e38, 1.0e6])[torch.randint(0, 3, shape, generator=generator)]
        return torch.where(future, junk, scores).to(device)

    def describe(self) -> str:
        return (f"scores ({self.batch}, {self.seq}, {self.seq}), topk={self.topk}, values={self.values} (huge or "
                f"+inf above the diagonal), seed={self.seed}")


@st.composite
def topk_cases(draw) -> TopkCase:
    seq = draw(dims(40 * size_scale()))
    return TopkCase(batch=draw(st.integers(1, 3)), seq=seq,
                    topk=draw(st.one_of(st.integers(1, max(1, seq // 2)), st.sampled_from(EDGE_TOPKS),
                                        st.integers(1, seq + 4))),
                    values=draw(st.sampled_from(("ties", "normal"))), seed=draw(st.integers(0, 2**31 - 1)))


def topk_by_rule(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The pinned selection written out row by row: the grader's own check of the reference's."""
    batch, seq, _ = scores.shape
    rows = []
    for b in range(batch):
        for t in range(seq):
            row = scores[b, t, :t + 1].tolist()
            chosen = sorted(sorted(range(t + 1), key=lambda s: (-row[s], s))[:topk])
            rows.append(chosen + [-1] * (topk - len(chosen)))
    return torch.tensor(rows, dtype=torch.int64).reshape(batch, seq, topk)


def call_unwatched(module, function: str, *args):
    """In the worker: module.function(*args), outside the watch that holds sparse_attention to Triton."""
    return getattr(module, function)(*args)


# --- attention over a selection ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SparseCase:
    batch: int
    seq: int
    heads: int
    head_dim: int
    topk: int
    dtype: torch.dtype
    selection: str = "causal"
    strided: bool = False  # q a view of [batch, heads, seq, head_dim]; k, v views of one [batch, seq, 2, head_dim]
    regime: str = "normal"
    seed: int = 0

    def exact_inputs(self) -> tuple[torch.Tensor, ...]:
        """q, k, v and dO in float64 on the CPU, holding exactly the case's values."""
        generator = torch.Generator().manual_seed(self.seed)
        q_shape = (self.batch, self.seq, self.heads, self.head_dim)
        kv_shape = (self.batch, self.seq, self.head_dim)
        if self.regime == "ties":
            q, k, v = (torch.randint(-2, 3, s, generator=generator).double() for s in (q_shape, kv_shape, kv_shape))
        else:
            q, k, v = (torch.randn(s, generator=generator, dtype=torch.float64) for s in (q_shape, kv_shape, kv_shape))
            if self.regime == "sharp":
                q = q * SHARP_FACTOR
        grad_o = torch.randn(q_shape, generator=generator, dtype=torch.float64)
        return tuple(t.to(self.dtype).double() for t in (q, k, v, grad_o))

    def indices(self) -> torch.Tensor:
        return selection_indices(self.selection, self.batch, self.seq, self.topk, self.seed)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """q, k, v in the case's dtype and layout, the indices, and dO, on the session's device."""
        device = current().device
        q, k, v, grad_o = (t.to(self.dtype) for t in self.exact_inputs())
        if self.strided:
            q = q.transpose(1, 2).contiguous().to(device).transpose(1, 2)
            packed = torch.stack([k, v], dim=2).to(device)
            k, v = packed[:, :, 0], packed[:, :, 1]
        else:
            q, k, v = q.to(device), k.to(device), v.to(device)
        return q, k, v, self.indices().to(device), grad_o.to(device)

    def describe(self) -> str:
        layout = "q a transposed view, k and v views of one packed tensor" if self.strided else "contiguous"
        return (f"q {(self.batch, self.seq, self.heads, self.head_dim)} [batch, seq, heads, head_dim], k and v "
                f"{(self.batch, self.seq, self.head_dim)}, indices ({self.batch}, {self.seq}, {self.topk}) "
                f"selection={self.selection}, dtype={_describe_dtype(self.dtype)}, layout={layout}, "
                f"values={self.regime}, seed={self.seed}")


def selection_indices(selection: str, batch: int, seq: int, topk: int, seed: int) -> torch.Tensor:
    """int64 [batch, seq, topk] on the CPU: every row names at least one key and none twice (see SELECTIONS)."""
    generator = torch.Generator().manual_seed(seed)
    if selection == "causal":
        scores = torch.rand(batch, seq, seq, generator=generator)
        return causal_topk(scores, topk)
    indices = torch.full((batch, seq, topk), -1, dtype=torch.int64)
    if selection == "shared":
        keys = torch.randperm(seq, generator=generator)[:topk]
        indices[..., :keys.numel()] = keys
        return indices
    for b in range(batch):
        for t in range(seq):
            count = 1 if selection == "single" else int(torch.randint(1, min(topk, seq) + 1, (), generator=generator))
            slots = torch.randperm(topk, generator=generator)[:count]
            indices[b, t, slots] = torch.randperm(seq, generator=generator)[:count]
    return indices


def causal_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Each query's topk highest of distinct random scores among keys s <= t, ascending, -1 padded."""
    seq = scores.shape[-1]
    positions = torch.arange(seq, device=scores.device)
    future = positions[None, :] > positions[:, None]
    kept = min(topk, seq)
    chosen = scores.masked_fill(future, -1.0).topk(kept, dim=-1).indices
    chosen = chosen.masked_fill(positions[None, :kept] > positions[:, None], seq).sort(dim=-1).values
    chosen = chosen.masked_fill(chosen == seq, -1)
    return torch.nn.functional.pad(chosen, (0, topk - kept), value=-1)


# Head sizes that are not powers of two, padded by the kernels to the next one: `ci` on a CPU draws only 16 and 32, so
# every profile grades 48, 80 and 96 explicitly, contiguous (the lanes past head_dim hold the next row's values) and
# strided (another head's, or the value beside the key).
PADDED_HEAD_DIMS = tuple(SparseCase(batch=1, seq=13, heads=3, head_dim=head_dim, topk=6, dtype=torch.float32,
                                    selection=selection, strided=strided, seed=head_dim)
                         for head_dim, selection, strided in ((48, "causal", False), (80, "any", True),
                                                              (96, "causal", True)))


@st.composite
def sparse_cases(draw, dtypes: tuple[torch.dtype, ...], seq=None, topk=None, head_dim: int | None = None,
                 heads=None, selections: tuple[str, ...] = ("causal", "any"), max_batch: int = 3) -> SparseCase:
    length = draw(seq if seq is not None else dims(40 * size_scale()))
    return SparseCase(
        batch=draw(st.integers(1, max_batch)),
        seq=length,
        heads=draw(heads if heads is not None else st.one_of(st.sampled_from((1, 16, 17)),
                                                             st.integers(1, 4 * size_scale()))),
        head_dim=head_dim or draw(st.sampled_from(head_dims())),
        topk=draw(topk if topk is not None else st.one_of(st.sampled_from(EDGE_TOPKS), st.integers(1, length + 8))),
        dtype=draw(st.sampled_from(dtypes)),
        selection=draw(st.sampled_from(selections)),
        strided=draw(st.booleans()),
        regime=draw(st.sampled_from(REGIMES)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def probe(module, q, k, v, indices, grad_o=None) -> dict:
    """module.sparse_attention(q, k, v, indices) and its backward from grad_o, under observation. Only q and dO
    must be read whole: a key no query selected is never loaded."""
    return observe(lambda *inputs: getattr(module, FUNCTION)(*inputs, indices), FUNCTION_CLASS + "Backward", q, k, v,
                   grad_o, PROBLEM.forbidden_ops, True, None, seq=q.shape[1], read_whole=("q",))


def run_probe(student, case: SparseCase, q, k, v, indices, grad_o=None, grader_work=None) -> tuple[dict, object]:
    with student.describing(case.describe()):
        report, grader_value = student.run_program_beside(grader_work, f"{__name__}:probe", q, k, v, indices,
                                                          grad_o)
    check_rules(report, True, grad_o is not None, case.describe(), FUNCTION)
    return report, grader_value


def probe_and_expect(student, reference, case: SparseCase, q, k, v, indices, grad_o=None) -> tuple[dict, Expected]:
    return run_probe(student, case, q, k, v, indices, grad_o,
                     lambda: reference.computed(expected, case, q, k, v, indices, grad_o))


def expected(reference, case: SparseCase, q, k, v, indices, grad_o=None) -> Expected:
    """The formula at float64 and the reference's kernels at the case's dtype (through reference.computed)."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    output64, lse64 = reference.sparse_attention_torch(q64, k64, v64, indices)
    want = Expected(output64.detach(), lse64.detach(), probe(reference, q, k, v, indices, grad_o))
    want.score_scale = float(torch.einsum("bthd,bsd->bths", q64.detach().abs(), k64.detach().abs()).max()
                             ) / math.sqrt(q.shape[-1])
    if grad_o is not None:
        output64.backward(grad_o.double())
        want.grads64 = (q64.grad, k64.grad, v64.grad)
        want.term_scales = gradient_term_scales(q, k, v, indices, grad_o)
    return want


def gradient_term_scales(q, k, v, indices, grad_o) -> tuple[float, float, float]:
    """The largest terms each gradient sums (grader.kernels.attention_cases.gradient_term_scales), over the selected
    keys only; dK and dV also sum over the heads that share a key."""
    q, k, v, grad_o = (t.detach().double().cpu().transpose(1, 2) if t.ndim == 4 else t.detach().double().cpu()
                       for t in (q, k, v, grad_o))
    batch, heads, seq, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim)
    visible = torch.zeros(batch, seq, seq + 1, dtype=torch.bool)
    visible.scatter_(2, torch.where(indices < 0, seq, indices).cpu(), True)
    scores = (q @ k[:, None].transpose(-1, -2) * scale).masked_fill(~visible[:, None, :, :seq], -math.inf)
    probs = torch.softmax(scores, dim=-1)
    output = probs @ v[:, None]
    bound = probs * (grad_o.abs() @ v[:, None].abs().transpose(-1, -2)
                     + (grad_o.abs() * output.abs()).sum(-1, keepdim=True))
    return (
        float((scale * bound @ k[:, None].abs()).max()),
        float((scale * bound.transpose(-1, -2) @ q.abs()).sum(1).max()),
        float((probs.transpose(-1, -2) @ grad_o.abs()).sum(1).max()),
    )


def check_saved(report: dict, seq: int, context: str) -> None:
    """Exactly (q, k, v, o, L, indices) saved, nothing kept on ctx, and no tensor spanning the sequence twice."""
    function_node(report, context, FUNCTION_CLASS)
    square = [shape for shape, _ in report["saved"] if is_square(shape, seq)]
    if square:
        raise WrongAnswer(f"{FUNCTION_CLASS} saved a tensor of shape {square[0]} for backward, two dimensions of "
                          f"length seq = {seq}; save only (q, k, v, o, L, indices) ({context})")
    if len(report["saved"]) != 6:
        raise WrongAnswer(f"{FUNCTION_CLASS} saved {describe_saved(report)}; it must save exactly "
                          f"(q, k, v, o, L, indices) ({context})")
    if report["ctx_tensors"]:
        raise WrongAnswer(f"{FUNCTION_CLASS} kept tensors on ctx outside save_for_backward "
                          f"({', '.join(report['ctx_tensors'])}); save exactly (q, k, v, o, L, indices) ({context})")
    if report["square_tensors"]:
        raise WrongAnswer(f"the call built tensors with two dimensions of length seq = {seq} in its forward or "
                          f"backward: {'; '.join(report['square_tensors'])}; the work and memory of attention over "
                          f"topk keys grow with seq x topk ({context})")


# --- work --------------------------------------------------------------------------------------------------------


def _random_inputs(seq: int, heads: int, head_dim: int, topk: int, dtype: torch.dtype, device) -> list:
    generator = torch.Generator(device=device).manual_seed(seq)
    q = torch.randn(1, seq, heads, head_dim, generator=generator, device=device, dtype=dtype)
    k, v = (torch.randn(1, seq, head_dim, generator=generator, device=device, dtype=dtype) for _ in range(2))
    indices = causal_topk(torch.rand(1, seq, seq, generator=generator, device=device), topk)
    return [q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True), indices, torch.randn_like(q)]


def loaded_lanes(module, lengths: tuple[int, ...], topk: int) -> list[int]:
    """In the worker, under the interpreter: the load lanes of one forward and backward at each length."""
    counts = []
    for seq in lengths:
        q, k, v, indices, grad_o = _random_inputs(seq, 2, 16, topk, torch.float32, "cpu")
        counts.append(work_growth.loaded_lanes(
            lambda: getattr(module, FUNCTION)(q, k, v, indices).backward(grad_o)))
    return counts


def seconds_per_call(module, lengths: tuple[int, ...], topk: int) -> list[float]:
    """In the worker, on the GPU: the median time of one forward and backward at each length (bfloat16, 16 heads,
    head size 64)."""
    times = []
    for seq in lengths:
        q, k, v, indices, grad_o = _random_inputs(seq, 16, 64, topk, torch.bfloat16, "cuda")
        times.append(work_growth.median_seconds(
            lambda: torch.autograd.grad(getattr(module, FUNCTION)(q, k, v, indices), (q, k, v), grad_o)))
    return times


def check_work_growth(counts: list[int], lengths: tuple[int, ...], topk: int) -> None:
    work_growth.check_work_growth(counts, lengths, f"topk {topk}", WORK_GROWTH_LIMIT,
                                  "attention over topk selected keys does the same work for every query, so the "
                                  "kernels must gather the selected rows instead of walking every earlier key")


def check_time_growth(times: list[float], lengths: tuple[int, ...], topk: int) -> None:
    work_growth.check_time_growth(times, lengths, f"topk {topk}", TIME_RATIO_LIMIT)
