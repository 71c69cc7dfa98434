"""What the sliding-window problem grades with: its cases (FlashAttention's, with a window), the probe that watches
`sliding_window_attention` run inside the worker, the float64 oracle, and the two measures of its work.

Work is measured two ways, both inside the worker (evidence against honest mistakes: code that defeats the hooks or
the clock is not caught here):
* under Triton's interpreter, the lanes of every load the kernels issue (grader.sandbox.triton_traffic), masked lanes
  included, for forward and backward at three sequence lengths with the window fixed: a kernel that skips the blocks
  outside the window does the same work for every extra block of queries, one that visits every block and masks does
  more for each;
* on a GPU, the time of forward and backward at two lengths four times apart with the window fixed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.attention import work_growth
from grader.checks.strategies import size_scale
from grader.kernels.attention_cases import (
    REGIMES,
    AttentionCase,
    Expected,
    check_rules,
    gradient_term_scales,
    head_dims,
    observe,
    sequence_lengths,
)

PROBLEM = BY_ID["attention.sliding_window"]
FUNCTION = "sliding_window_attention"
FUNCTION_CLASS = "SlidingWindowAttentionFunction"
# Windows at and around the reference's interpreter tiles (16 and 32 rows) and the GPU's (64 and 128).
EDGE_WINDOWS = (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129)
# Interpreter work: lengths 256 apart, multiples of every power-of-two block up to 256, window well inside one step.
WORK_LENGTHS = (256, 512, 768)
WORK_WINDOW = 16
# The next 256 queries may cost this much more than the previous 256 (a kernel that skips exactly does 1.0; one
# that visits every causal block does 1.67).
WORK_GROWTH_LIMIT = 1.2
# GPU time: forward and backward at T and 4 T, window 256; linear work takes 4x, causal work 16x.
TIME_LENGTHS = (4096, 16384)
TIME_WINDOW = 256
TIME_RATIO_LIMIT = 6.0


@dataclass(frozen=True)
class WindowCase(AttentionCase):
    window: int = 1

    def describe(self) -> str:
        return super().describe().replace("is_causal=True, ", "") + f", window={self.window}"


@st.composite
def window_cases(draw, dtypes: tuple[torch.dtype, ...], seq=None, window=None, head_dim: int | None = None,
                 max_pairs: int | None = None):
    """FlashAttention's cases (4-D, causal) with a window: near the tile edges, from 1 to past the sequence."""
    max_pairs = max_pairs or min(3 * size_scale(), 16)
    batch = draw(st.integers(1, max_pairs))
    length = draw(seq if seq is not None else sequence_lengths(40 * size_scale()))
    return WindowCase(
        batch=batch,
        heads=draw(st.integers(1, max_pairs // batch)),
        seq=length,
        head_dim=head_dim or draw(st.sampled_from(head_dims())),
        dtype=draw(st.sampled_from(dtypes)),
        is_causal=True,
        layout=draw(st.sampled_from(("contiguous", "bnhd", "packed_qkv"))),
        regime=draw(st.sampled_from(REGIMES)),
        seed=draw(st.integers(0, 2**31 - 1)),
        window=draw(window if window is not None else st.one_of(st.sampled_from(EDGE_WINDOWS),
                                                                 st.integers(1, length + 8))),
    )


def padded_head_dim_case(head_dim: int, layout: str) -> WindowCase:
    """A head size that is not a power of two: the kernels pad it to the next one, and the lanes past head_dim must
    load as zeros. `ci` on a CPU draws only 16 and 32, so every profile grades 48, 80 and 96 explicitly, with a window
    across a tile's edge."""
    return WindowCase(batch=1, heads=2, seq=37, head_dim=head_dim, dtype=torch.float32, is_causal=True, layout=layout,
                      seed=head_dim, window=17)


# One per layout, so the memory past head_dim differs: the next row (contiguous), the next head (bnhd), the next head or
# the next of q, k and v (packed_qkv); past the last head's last row, the end of the tensor.
PADDED_HEAD_DIMS = tuple(padded_head_dim_case(head_dim, layout)
                         for head_dim, layout in ((48, "contiguous"), (80, "bnhd"), (96, "packed_qkv")))


def edge_case(seq: int, window: int, dtype=torch.float32) -> WindowCase:
    return WindowCase(batch=1, heads=2, seq=seq, head_dim=16, dtype=dtype, is_causal=True, seed=seq * 1000 + window,
                      window=window)


def probe(module, q, k, v, window: int, grad_o=None) -> dict:
    """module.sliding_window_attention(q, k, v, window) and its backward from grad_o, under observation."""
    return observe(lambda *inputs: getattr(module, FUNCTION)(*inputs, window), FUNCTION_CLASS + "Backward", q, k, v,
                   grad_o, PROBLEM.forbidden_ops, True, None)


def run_probe(student, case: WindowCase, q, k, v, grad_o=None, grader_work=None) -> tuple[dict, object]:
    with student.describing(case.describe()):
        report, grader_value = student.run_program_beside(grader_work, f"{__name__}:probe", q, k, v, case.window,
                                                          grad_o)
    check_rules(report, True, grad_o is not None, case.describe(), FUNCTION)
    return report, grader_value


def probe_and_expect(student, reference, case: WindowCase, q, k, v, grad_o=None) -> tuple[dict, Expected]:
    return run_probe(student, case, q, k, v, grad_o, lambda: reference.computed(expected, case, q, k, v, grad_o))


def expected(reference, case: WindowCase, q, k, v, grad_o=None) -> Expected:
    """The formula at float64 and the reference's kernels at the case's dtype (through reference.computed)."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    output64, lse64 = reference.sliding_window_attention_torch(q64, k64, v64, case.window)
    want = Expected(output64.detach(), lse64.detach(), probe(reference, q, k, v, case.window, grad_o))
    want.score_scale = float((q64.detach().abs() @ k64.detach().abs().transpose(-1, -2)).max()) / math.sqrt(q.shape[-1])
    if grad_o is not None:
        output64.backward(grad_o.double())
        want.grads64 = (q64.grad, k64.grad, v64.grad)
        want.term_scales = gradient_term_scales(q, k, v, grad_o, True, case.window)
    return want


# --- work --------------------------------------------------------------------------------------------------------


def _random_inputs(seq: int, head_dim: int, dtype: torch.dtype, device, heads: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(seq)
    return [torch.randn(1, heads, seq, head_dim, generator=generator, device=device, dtype=dtype)
            for _ in range(4)]


def loaded_lanes(module, lengths: tuple[int, ...], window: int) -> list[int]:
    """In the worker, under the interpreter: the load lanes of one forward and backward at each length."""
    counts = []
    for seq in lengths:
        q, k, v, grad_o = _random_inputs(seq, 16, torch.float32, "cpu")
        inputs = [t.requires_grad_(True) for t in (q, k, v)]
        counts.append(work_growth.loaded_lanes(lambda: getattr(module, FUNCTION)(*inputs, window).backward(grad_o)))
    return counts


def seconds_per_call(module, lengths: tuple[int, ...], window: int) -> list[float]:
    """In the worker, on the GPU: the median time of one forward and backward at each length (bfloat16, 16 heads,
    head size 64)."""
    times = []
    for seq in lengths:
        q, k, v, grad_o = _random_inputs(seq, 64, torch.bfloat16, "cuda", heads=16)
        inputs = [t.requires_grad_(True) for t in (q, k, v)]
        times.append(work_growth.median_seconds(
            lambda: torch.autograd.grad(getattr(module, FUNCTION)(*inputs, window), inputs, grad_o)))
    return times


def check_work_growth(counts: list[int], lengths: tuple[int, ...], window: int) -> None:
    work_growth.check_work_growth(counts, lengths, f"window {window}", WORK_GROWTH_LIMIT,
                                  "a window's work grows linearly in seq, so the kernels must skip the blocks outside "
                                  "it instead of loading and masking them")


def check_time_growth(times: list[float], lengths: tuple[int, ...], window: int) -> None:
    work_growth.check_time_growth(times, lengths, f"window {window}", TIME_RATIO_LIMIT)
