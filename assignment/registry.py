"""The problem registry: every graded problem, its points, example budgets, time limits and speed thresholds, and
the time estimate and learning goal the handout states for it.

One entry per problem, in teaching order (the handout's and the score table's): within each family, from the idea a
student needs first to the ones that build on it. What an entry leaves out is its family's (FAMILY_DEFAULTS). The
entry's `id` is also the module path of the problem under an implementation package (`kernels.softmax` ->
`student_impl/kernels/softmax.py`), the suffix of its grader test module (`grader/kernels/test_softmax.py`) and of its
handout section (`assignment/handout/sections/kernels/softmax.typ`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

PROFILES = ("ci", "public", "grading")
# A test's budget of student time is this multiple of the reference's time on the same inputs in the same test, and at
# least the problem's `test_timeout_s` (see grader.session.budget).
REFERENCE_TIME_MULTIPLE = 10.0
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class SpeedThreshold:
    """Points for speed, by the ratio student_time / reference_time measured in one run on one GPU."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    # (max ratio, fraction of the speed points) from the strictest tier to the loosest.
    tiers: tuple[tuple[float, float], ...] = ((1.25, 1.0), (2.0, 0.5))

    def cases(self) -> list[tuple[tuple[int, ...], str]]:
        return [(shape, dtype) for shape in self.shapes for dtype in self.dtypes]


@dataclass(frozen=True)
class FamilyDefaults:
    """What a family's problems have unless their entry says otherwise."""

    budgets: dict[str, int]
    call_timeout_s: float = 60.0
    world_sizes: tuple[int, ...] = ()


FAMILY_DEFAULTS = {
    "kernels": FamilyDefaults(budgets={"ci": 6, "public": 25, "grading": 150}),
    # Each example runs Triton's interpreter on a CPU: a chunked form costs seconds there.
    "attention": FamilyDefaults(budgets={"ci": 3, "public": 10, "grading": 30}),
    "moe": FamilyDefaults(budgets={"ci": 10, "public": 40, "grading": 250}),
    # Each example launches ranks (seconds, not milliseconds), which also wait on one another.
    "parallel": FamilyDefaults(budgets={"ci": 1, "public": 2, "grading": 5}, call_timeout_s=90.0, world_sizes=(2, 4)),
}


@dataclass(frozen=True)
class Problem:
    id: str
    title: str
    # Points per test group; a group is one test function of the problem's grader module, named without `test_`.
    # A parametrised test shares its group's points equally between its cases.
    points: dict[str, float]
    # The handout's opening box of the problem: about how many hours it takes, and what the student learns from it
    # (a phrase that follows "You learn"). Every problem states both (tests/test_registry.py).
    hours: float | None = None
    learns: str = ""
    # The ids of earlier problems whose code or ideas this one directly uses: direct prerequisites only, not what they
    # build on in turn. Teaching order follows them (every one comes earlier in PROBLEMS, tests/test_registry.py), and
    # the handout's map of the problems (figures_map.typ) draws each as an arrow.
    builds_on: tuple[str, ...] = ()
    # Hypothesis examples per test, by profile (empty: the family's).
    budgets: dict[str, int] = field(default_factory=dict)
    # Seconds one call into student code may take (None: the family's), and the least seconds one whole test may
    # spend in student code.
    call_timeout_s: float | None = None
    test_timeout_s: float = 300.0
    speed: SpeedThreshold | None = None
    # Numbers of ranks the distributed tests use (None: the family's; () for a problem that launches no ranks). The
    # grader's --world-sizes replaces them for a run (grader.session.context.world_sizes).
    world_sizes: tuple[int, ...] | None = None
    # Tolerance calibration: the student's error against a float64 evaluation may be at most `error_multiple`
    # times the reference's own error at the same dtype, plus a floor of `floor_ulps` units of the dtype's epsilon
    # (relative to the output's magnitude).
    error_multiple: float = 4.0
    floor_ulps: float = 8.0
    # The student's code runs under these rules (grader.sandbox.worker): torch operators it may not call (the work it
    # is to do itself), and whether its forward and backward must each launch a Triton kernel.
    forbidden_ops: tuple[str, ...] = ()
    uses_triton: bool = False
    # parallel.activation_checkpointing: the fraction of the plain block's saved bytes a checkpointed block may hold.
    held_fraction: float | None = None
    # parallel.fsdp: the error multiple of its bf16 compute test (bf16 rounding compounds over the training steps).
    bf16_error_multiple: float | None = None
    # Parallel family and analysis problems: per test group, what its points rest on. "outside": values the grader
    # compares with its own computation, which a rank given only its own inputs cannot produce without its peers (or an
    # answer sheet read as data); "in-process": what the student's process records about itself (collectives, phases,
    # memory, raised exceptions), which catches honest mistakes but can be forged by code that rewrites its own
    # process. The handout prints it.
    evidence: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        defaults = FAMILY_DEFAULTS[self.family]
        if not self.budgets:
            object.__setattr__(self, "budgets", dict(defaults.budgets))
        if self.call_timeout_s is None:
            object.__setattr__(self, "call_timeout_s", defaults.call_timeout_s)
        if self.world_sizes is None:
            object.__setattr__(self, "world_sizes", defaults.world_sizes)

    @property
    def family(self) -> str:
        return self.id.split(".")[0]

    @property
    def name(self) -> str:
        return self.id.split(".")[1]

    @property
    def module_path(self) -> str:
        return f"{self.family}/{self.name}.py"

    @property
    def test_module(self) -> str:
        return f"grader/{self.family}/test_{self.name}.py"

    @property
    def handout_section(self) -> Path:
        return ROOT / "assignment" / "handout" / "sections" / self.family / f"{self.name}.typ"

    @property
    def max_points(self) -> float:
        return sum(self.points.values())


# Attention's own kernels, in torch or behind the softmax, which both attention problems write themselves.
ATTENTION_FORBIDDEN_OPS = (
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
    "aten._softmax",
    "aten.softmax",
    "aten._safe_softmax",
)

# The linear-attention problems write their own recurrences; softmax attention is not part of any of them.
LINEAR_ATTENTION_FORBIDDEN_OPS = ATTENTION_FORBIDDEN_OPS[:6]

# An analysis problem's answers are data, read from the student's sheet in the grader's process (grader.checks.answers).
SHEET_EVIDENCE = "outside: the answer sheet is read as data in the grader's process and compared with its derivation"
# The timing of a measured answer runs in the student's worker, as the speed tests' does (grader.speed.grading).
MEASURED_EVIDENCE = ("in-process: on a GPU, compared with the grader's timing of your kernel, taken in your worker; "
                     "without one, checked for consistency only")

PROBLEMS: tuple[Problem, ...] = (
    Problem(
        id="kernels.gelu",
        title="GeLU in Triton",
        hours=2,
        learns=(
            "how a Triton program covers one block of elements, masks the ragged edge, and computes in float32 "
            "whatever the storage dtype"
        ),
        points={
            "matches_reference_fp32": 4,
            "matches_reference_fp16": 2,
            "matches_reference_bf16": 2,
            "extreme_values": 2,
            "invalid_arguments": 1,
            "speed": 2,
        },
        uses_triton=True,
        forbidden_ops=("aten.gelu", "aten.gelu_"),
        speed=SpeedThreshold(shapes=((8192, 8192),)),
    ),
    Problem(
        id="kernels.row_sum",
        title="Row sums in Triton",
        hours=2,
        builds_on=("kernels.gelu",),
        learns="to reduce along rows of any length with a blocked loop and a float32 accumulator",
        points={
            "matches_reference_fp32": 4,
            "matches_reference_fp16": 2,
            "matches_reference_bf16": 2,
            "long_rows": 3,
            "float32_accumulator": 2,
            "invalid_arguments": 1,
            "speed": 2,
        },
        uses_triton=True,
        # One packet: Tensor.sum(), torch.sum(x, dim) and the dtype= forms all dispatch to overloads of aten.sum.
        forbidden_ops=("aten.sum",),
        speed=SpeedThreshold(shapes=((8192, 8192), (1024, 65536))),
    ),
    Problem(
        id="kernels.softmax",
        title="Softmax in Triton",
        hours=3,
        builds_on=("kernels.row_sum",),
        learns=(
            "a softmax that cannot overflow, and the online maximum and sum that stream a row longer than one block "
            "through once"
        ),
        points={
            "matches_reference_fp32": 5,
            "matches_reference_fp16": 3,
            "matches_reference_bf16": 2,
            "long_rows": 4,
            "large_magnitudes": 3,
            "invalid_arguments": 1,
            "speed": 4,
        },
        uses_triton=True,
        forbidden_ops=("aten._softmax", "aten.softmax", "aten._safe_softmax", "aten.special_softmax"),
        speed=SpeedThreshold(shapes=((8192, 4096), (4096, 32768))),
    ),
    Problem(
        id="kernels.rmsnorm",
        title="RMSNorm forward and backward in Triton",
        hours=4,
        builds_on=("kernels.row_sum",),
        learns="to write a backward pass in Triton: an autograd function whose weight gradient sums over every row",
        points={
            "forward_fp32": 4,
            "forward_fp16": 2,
            "forward_bf16": 2,
            "backward_fp32": 5,
            "backward_fp16": 2,
            "invalid_arguments": 1,
            "speed": 2,
        },
        budgets={"ci": 5, "public": 20, "grading": 120},
        uses_triton=True,
        forbidden_ops=("aten.rms_norm", "aten._fused_rms_norm", "aten._fused_rms_norm_backward"),
        # 16384 x 8192: long enough (~0.1 ms in bf16) that launch jitter cannot move a verdict; at 8192 x 4096 the
        # reference against itself ranged 0.65-1.67x.
        speed=SpeedThreshold(shapes=((16384, 8192),)),
    ),
    Problem(
        id="kernels.matmul",
        title="Tiled matrix multiplication in Triton",
        hours=5,
        builds_on=("kernels.gelu",),
        learns=(
            "tiling for reuse: blocks of both operands on chip, a float32 accumulator, a cache-friendly program "
            "order and a fused epilogue"
        ),
        points={
            "matches_reference_fp32": 4,
            "matches_reference_fp16": 4,
            "matches_reference_bf16": 2,
            "k_remainder": 3,
            "gelu_epilogue": 3,
            "float32_accumulator": 2,
            "invalid_arguments": 1,
            "speed": 3,
        },
        budgets={"ci": 5, "public": 20, "grading": 120},
        uses_triton=True,
        forbidden_ops=(
            "aten.mm",
            "aten.matmul",
            "aten.addmm",
            "aten._addmm_activation",
            "aten.bmm",
            "aten.baddbmm",
            "aten.addbmm",
            "aten.dot",
            "aten.vdot",
            "aten.mv",
            "aten.addmv",
            "aten.linear",
            "aten.einsum",
            "aten.tensordot",
        ),
        speed=SpeedThreshold(shapes=((4096, 4096, 4096),), dtypes=("bfloat16", "float16")),
        # A lower floor than the default: at GPU sizes (K in the thousands) it separates an fp16 accumulator (about
        # 1.3 ulps of the output's scale) from fp32 accumulation.
        floor_ulps=2.0,
    ),
    Problem(
        id="kernels.flash_attention_torch",
        title="FlashAttention-2 in PyTorch",
        hours=5,
        builds_on=("kernels.softmax",),
        learns=(
            "the FlashAttention-2 algorithm in plain PyTorch tiles: the online softmax over key blocks, the "
            "log-sum-exp kept for backward, and a backward that recomputes the scores"
        ),
        points={
            "forward": 4,
            "logsumexp": 2,
            "backward": 5,
            "causal": 4,
            "saves_no_score_matrix": 3,
            "invalid_arguments": 1,
        },
        budgets={"ci": 5, "public": 20, "grading": 120},
        forbidden_ops=ATTENTION_FORBIDDEN_OPS,
    ),
    Problem(
        id="kernels.flash_attention_triton",
        title="FlashAttention-2 in Triton",
        hours=8,
        builds_on=("kernels.flash_attention_torch", "kernels.matmul"),
        learns=(
            "to turn that algorithm into Triton kernels, forward and backward, skipping the blocks a causal mask "
            "hides"
        ),
        points={
            "forward_fp32": 4,
            "forward_fp16": 3,
            "forward_bf16": 2,
            "logsumexp": 2,
            "backward": 6,
            "causal": 4,
            "saves_no_score_matrix": 2,
            "blocks_bounded": 2,
            "invalid_arguments": 1,
            "speed": 4,
        },
        budgets={"ci": 4, "public": 15, "grading": 100},
        uses_triton=True,
        forbidden_ops=ATTENTION_FORBIDDEN_OPS,
        # Forward only, against the reference and torch's FlashAttention-2 (SDPA's flash backend); shape is
        # (batch, heads, seq, head_dim, causal).
        speed=SpeedThreshold(shapes=((4, 16, 4096, 64, 0), (4, 16, 4096, 128, 1)), dtypes=("bfloat16",)),
    ),
    Problem(
        id="kernels.analysis",
        title="Analysis questions: Triton kernels",
        hours=2,
        builds_on=("kernels.softmax", "kernels.matmul", "kernels.flash_attention_triton"),
        learns="to measure what your kernels reach against a copy's bandwidth, and to count the work and traffic of a "
        "tiled matmul and of FlashAttention before writing them",
        points={
            "softmax_copy_fraction": 3,
            "softmax_copy_fraction_small": 2,
            "softmax_small_reason": 2,
            "matmul_tile_intensity": 2,
            "flash_key_blocks": 2,
        },
        world_sizes=(),
        evidence={
            "softmax_copy_fraction": MEASURED_EVIDENCE,
            "softmax_copy_fraction_small": MEASURED_EVIDENCE,
            "softmax_small_reason": SHEET_EVIDENCE,
            "matmul_tile_intensity": SHEET_EVIDENCE,
            "flash_key_blocks": SHEET_EVIDENCE,
        },
    ),
    Problem(
        id="attention.sliding_window",
        title="Sliding-window attention in Triton",
        hours=6,
        builds_on=("kernels.flash_attention_triton",),
        learns=(
            "to attend to the last w keys only, and to make the kernels skip every block outside the window so that "
            "the work grows with seq times w, not seq squared"
        ),
        points={
            "forward_fp32": 4,
            "forward_fp16": 2,
            "forward_bf16": 2,
            "logsumexp": 2,
            "backward": 6,
            "window_edges": 3,
            "saves_no_score_matrix": 2,
            "blocks_bounded": 1,
            "work_linear_in_seq": 4,
            "invalid_arguments": 1,
            "speed": 4,
        },
        uses_triton=True,
        forbidden_ops=ATTENTION_FORBIDDEN_OPS,
        # Forward and backward against the reference and torch's causal FlashAttention-2 over the whole sequence;
        # shape is (batch, heads, seq, head_dim, window).
        speed=SpeedThreshold(shapes=((4, 16, 8192, 64, 512), (4, 16, 8192, 128, 1024)), dtypes=("bfloat16",)),
    ),
    Problem(
        id="attention.sparse_dsa",
        title="DeepSeek sparse attention",
        hours=6,
        builds_on=("kernels.flash_attention_triton",),
        learns=(
            "the sparse attention of DeepSeek-V3.2: a cheap indexer scores every past token, each query keeps its "
            "top-k, and a Triton kernel gathers the selected key rows so that attention costs seq times k, not seq "
            "squared"
        ),
        points={
            "indexer": 3,
            "topk": 3,
            "topk_edges": 1,
            "forward_fp32": 3,
            "forward_fp16": 2,
            "forward_bf16": 2,
            "logsumexp": 2,
            "backward": 5,
            "selections": 3,
            "saves_no_score_matrix": 2,
            "blocks_bounded": 1,
            "work_linear_in_seq": 4,
            "invalid_arguments": 1,
            "speed": 4,
        },
        uses_triton=True,
        forbidden_ops=ATTENTION_FORBIDDEN_OPS,
        # Forward and backward against the reference and torch's causal FlashAttention-2 over the whole sequence
        # (keys and values repeated per head); shape is (batch, seq, heads, head_dim, topk).
        speed=SpeedThreshold(shapes=((2, 8192, 16, 64, 512), (1, 8192, 64, 128, 2048)), dtypes=("bfloat16",)),
    ),
    Problem(
        id="attention.mla",
        title="Multi-head latent attention",
        hours=5,
        learns=(
            "to cache one latent vector and one rotary key per token instead of every head's keys and values, and "
            "to decode from them by moving the query into the latent space"
        ),
        points={
            "forward": 5,
            "gradients": 4,
            "decode_matches_forward": 6,
            "cache_holds_latents_only": 3,
            "decode_builds_no_per_head_keys": 3,
            "decode_appends_in_place": 3,
            "cache_bytes": 2,
            "invalid_arguments": 1,
        },
        # Plain PyTorch on small layers: an example costs a fraction of a second.
        budgets={"ci": 5, "public": 20, "grading": 100},
    ),
    Problem(
        id="attention.mtp",
        title="Multi-token prediction",
        hours=3,
        learns=(
            "the chain of prediction modules of DeepSeek-V3: which token each depth reads and predicts, the shared "
            "embedding and head, and a loss that keeps every prediction causal"
        ),
        points={
            "logits": 5,
            "loss": 4,
            "gradients": 5,
            "causal_chain": 3,
            "invalid_arguments": 1,
        },
        # Plain PyTorch on small models: an example costs a fraction of a second.
        budgets={"ci": 5, "public": 20, "grading": 100},
    ),
    Problem(
        id="attention.linear_attention",
        title="Linear attention: parallel, recurrent and chunked",
        hours=6,
        builds_on=("kernels.flash_attention_triton",),
        learns=(
            "why attention without a softmax is a recurrence with a fixed-size state, and the chunked form that "
            "trains it at matrix-multiply speed"
        ),
        points={
            "parallel_form": 3,
            "recurrent_form": 3,
            "chunked_fp32": 4,
            "chunked_fp16": 2,
            "chunked_bf16": 2,
            "backward": 5,
            "forms_agree": 2,
            "memory_discipline": 3,
            "invalid_arguments": 1,
            "speed": 4,
        },
        uses_triton=True,
        forbidden_ops=LINEAR_ATTENTION_FORBIDDEN_OPS,
        # Forward and backward; shape is (batch, heads, seq, head_dim).
        speed=SpeedThreshold(shapes=((4, 16, 4096, 64), (4, 16, 4096, 128)), dtypes=("bfloat16",)),
        floor_ulps=16.0,
    ),
    Problem(
        id="attention.mamba2",
        title="Mamba-2: scalar-gated linear attention in log space",
        hours=6,
        builds_on=("attention.linear_attention",),
        learns="a state that decays, computed stably in log space across chunks, with a state passed in and out",
        points={
            "recurrent_form": 3,
            "chunked_fp32": 4,
            "chunked_fp16": 2,
            "chunked_bf16": 2,
            "backward": 6,
            "forms_agree": 2,
            "stability": 3,
            "state_handoff": 3,
            "memory_discipline": 3,
            "invalid_arguments": 1,
            "speed": 4,
        },
        uses_triton=True,
        forbidden_ops=LINEAR_ATTENTION_FORBIDDEN_OPS,
        speed=SpeedThreshold(shapes=((4, 16, 4096, 64), (4, 16, 4096, 128)), dtypes=("bfloat16",)),
        floor_ulps=16.0,
    ),
    Problem(
        id="attention.gated_deltanet",
        title="Gated DeltaNet, chunked through the WY representation",
        hours=10,
        builds_on=("attention.mamba2",),
        learns=(
            "the delta rule's state update, and the WY representation that chunks it with one triangular solve per "
            "chunk"
        ),
        points={
            "recurrent_form": 3,
            "chunked_fp32": 5,
            "chunked_fp16": 2,
            "chunked_bf16": 2,
            "backward": 6,
            "forms_agree": 2,
            "stability": 3,
            "state_handoff": 3,
            "memory_discipline": 3,
            "invalid_arguments": 1,
            "speed": 4,
        },
        uses_triton=True,
        forbidden_ops=LINEAR_ATTENTION_FORBIDDEN_OPS + ("aten.linalg_solve_triangular", "aten.linalg_inv_ex",
                                                        "aten.triangular_solve"),
        speed=SpeedThreshold(shapes=((4, 16, 4096, 64), (4, 16, 4096, 128)), dtypes=("bfloat16",)),
        floor_ulps=16.0,
    ),
    Problem(
        id="attention.hybrid",
        title="A hybrid stack: Gated DeltaNet and softmax attention, prefill and decode",
        hours=5,
        builds_on=("attention.gated_deltanet",),
        learns=(
            "to decode token by token: a fixed-size recurrent state beside a growing KV cache, and what each costs "
            "in memory"
        ),
        points={
            "forward": 5,
            "gradients": 3,
            "decode_matches_forward": 6,
            "linear_state_is_constant": 3,
            "kv_cache_grows": 2,
            "cache_bytes": 2,
            "invalid_arguments": 1,
        },
        # Plain PyTorch on small stacks: an example costs a fraction of a second, not the interpreter's seconds.
        budgets={"ci": 5, "public": 20, "grading": 100},
    ),
    Problem(
        id="attention.analysis",
        title="Analysis questions: attention",
        hours=2,
        builds_on=("attention.sliding_window", "attention.linear_attention"),
        learns="to price each attention variant in query-key pairs and cache bytes, to measure how much of the work "
        "a sliding window saves turns into speed, and to find the length where linear attention's cheaper work wins",
        points={
            "window_work_ratio": 2,
            "sliding_window_speedup": 3,
            "linear_attention_crossover_seq": 3,
            "dsa_attended_fraction": 2,
            "mla_cache_ratio": 2,
        },
        world_sizes=(),
        evidence={
            "window_work_ratio": SHEET_EVIDENCE,
            "sliding_window_speedup": MEASURED_EVIDENCE,
            "linear_attention_crossover_seq": MEASURED_EVIDENCE,
            "dsa_attended_fraction": SHEET_EVIDENCE,
            "mla_cache_ratio": SHEET_EVIDENCE,
        },
    ),
    Problem(
        id="moe.router",
        title="Top-k token-choice router",
        hours=3,
        learns=(
            "top-k token-choice routing with exact tie-breaking, the balance loss and the router z-loss, and their "
            "gradients"
        ),
        points={
            "indices_and_gates": 5,
            "tie_breaking": 2,
            "tokens_per_expert": 2,
            "losses": 4,
            "gradients": 4,
            "low_precision_inputs": 2,
            "invalid_arguments": 1,
        },
        budgets={"ci": 15, "public": 40, "grading": 250},
    ),
    Problem(
        id="moe.noisy_topk",
        title="Noisy top-k gating",
        hours=2,
        builds_on=("moe.router",),
        learns="how learned noise on the logits lets a router explore in training and stay deterministic in evaluation",
        points={
            "indices_and_gates": 5,
            "eval_is_noise_free": 3,
            "noisy_logits": 2,
            "tie_breaking": 1,
            "gradients": 3,
            "invalid_arguments": 1,
        },
    ),
    Problem(
        id="moe.capacity",
        title="Expert capacity and token dropping",
        hours=3,
        builds_on=("moe.router",),
        learns=(
            "how fixed-size expert buffers force token dropping, and the priority that decides which assignments "
            "stay"
        ),
        points={
            "capacity": 2,
            "kept_set": 5,
            "positions": 3,
            "gates": 3,
            "invalid_arguments": 1,
        },
    ),
    Problem(
        id="moe.expert_choice",
        title="Expert-choice routing",
        hours=2,
        builds_on=("moe.router",),
        learns="routing turned around: each expert picks its tokens, so the load is balanced by construction",
        points={
            "tokens_and_gates": 5,
            "capacity": 2,
            "tie_breaking": 2,
            "experts_per_token": 2,
            "gradients": 4,
            "low_precision_inputs": 2,
            "invalid_arguments": 1,
        },
    ),
    Problem(
        id="moe.sigmoid_router",
        title="Sigmoid router with a selection-only bias",
        hours=2,
        builds_on=("moe.router",),
        learns="sigmoid affinities, and a bias that steers which experts are chosen without changing the gates",
        points={
            "indices_and_gates": 5,
            "tie_breaking": 2,
            "tokens_per_expert": 1,
            "gradients": 3,
            "low_precision_inputs": 1,
            "invalid_arguments": 1,
        },
    ),
    Problem(
        id="moe.bias_balancing",
        title="Auxiliary-loss-free bias balancing",
        hours=1,
        builds_on=("moe.sigmoid_router",),
        learns="to balance experts without an auxiliary loss: the bias update from the loads a step observed",
        points={
            "loads": 3,
            "bias_update": 4,
            "experts_at_the_mean": 2,
            "invalid_arguments": 1,
        },
    ),
    Problem(
        id="moe.sequence_balance_loss",
        title="Sequence-wise balance loss",
        hours=2,
        builds_on=("moe.sigmoid_router",),
        learns="a balance loss taken per sequence, which sees an imbalance a batch-wide loss hides",
        points={
            "loss": 4,
            "even_routing": 2,
            "gradients": 4,
            "low_precision_inputs": 2,
            "invalid_arguments": 1,
        },
    ),
    Problem(
        id="moe.group_limited_routing",
        title="Group-limited routing",
        hours=2,
        builds_on=("moe.sigmoid_router",),
        learns="to bound each token's communication by choosing groups of experts before the experts",
        points={
            "groups_and_experts": 5,
            "gates": 3,
            "tie_breaking": 2,
            "gradients": 2,
            "invalid_arguments": 1,
        },
    ),
    Problem(
        id="moe.moe_layer",
        title="The MoE feed-forward layer",
        hours=5,
        builds_on=("moe.router",),
        learns="the whole layer: tokens sorted by expert, one product per expert, shared experts and the gated combine",
        points={
            "output": 4,
            "gradients": 5,
            "uneven_and_empty_experts": 3,
            "edge_sizes": 2,
            "bf16": 2,
            "batched_dispatch": 2,
            "sparse_compute": 2,
            "invalid_arguments": 1,
            "speed": 4,
        },
        budgets={"ci": 6, "public": 25, "grading": 150},
        # Forward and backward against the reference and an idealised grouped GEMM; shape is
        # (tokens, hidden D, expert hidden H, routed experts E, k, shared experts S).
        speed=SpeedThreshold(shapes=((16384, 2048, 1408, 64, 6, 2),), dtypes=("bfloat16",)),
    ),
    Problem(
        id="moe.upcycle",
        title="Upcycling a dense MLP into experts",
        hours=2,
        builds_on=("moe.moe_layer",),
        learns="to turn a trained dense MLP into experts whose layer reproduces it exactly at initialisation",
        points={
            "expert_copies": 3,
            "experts_independent": 2,
            "router_init": 2,
            "matches_dense": 3,
            "invalid_arguments": 1,
        },
        budgets={"ci": 4, "public": 15, "grading": 60},
    ),
    Problem(
        id="moe.accounting",
        title="Total and activated parameters of an MoE model",
        hours=2,
        builds_on=("moe.moe_layer",),
        learns="to count an MoE model's total and activated parameters term by term",
        points={
            "published_shapes": 4,
            "drawn_configs": 3,
            "invalid_arguments": 1,
        },
        budgets={"ci": 20, "public": 100, "grading": 500},
    ),
    Problem(
        id="moe.analysis",
        title="Analysis questions: mixture of experts",
        hours=1,
        builds_on=("moe.router", "moe.capacity", "moe.accounting"),
        learns="to predict what capacity drops, what the balance loss reads when routing collapses, and how little of "
        "a large MoE model one token uses",
        points={
            "capacity_slots": 1,
            "capacity_dropped": 2,
            "balance_loss_two_experts": 2,
            "activated_fraction": 2,
        },
        world_sizes=(),
        evidence={
            "capacity_slots": SHEET_EVIDENCE,
            "capacity_dropped": SHEET_EVIDENCE,
            "balance_loss_two_experts": SHEET_EVIDENCE,
            "activated_fraction": SHEET_EVIDENCE,
        },
    ),
    Problem(
        id="parallel.collectives",
        title="Collectives from point-to-point messages",
        hours=6,
        learns=(
            "how broadcast, reduce, gathers, scatters, all-reduce and all-to-all are built from messages, and what "
            "each costs in bytes"
        ),
        points={
            "broadcast": 2,
            "scatter": 2,
            "gather": 2,
            "reduce": 3,
            "all_gather": 3,
            "reduce_scatter": 4,
            "all_reduce": 6,
            "all_to_all": 4,
            "process_groups": 3,
            "invalid_arguments": 1,
        },
        call_timeout_s=60.0,
        evidence={
            "broadcast": (
                "outside: results equal what the grader computes from every rank's inputs; in-process: the send/recv "
                "rule"
            ),
            "scatter": (
                "outside: results equal what the grader computes from every rank's inputs; in-process: the send/recv "
                "rule"
            ),
            "gather": (
                "outside: results equal what the grader computes from every rank's inputs; in-process: the send/recv "
                "rule"
            ),
            "reduce": (
                "outside: results equal what the grader computes from every rank's inputs; in-process: the send/recv "
                "rule"
            ),
            "all_gather": (
                "outside: results equal what the grader computes from every rank's inputs; in-process: the send/recv "
                "rule"
            ),
            "reduce_scatter": (
                "outside: results equal what the grader computes from every rank's inputs; in-process: the send/recv "
                "rule"
            ),
            "all_reduce": (
                "outside: results equal what the grader computes from every rank's inputs; in-process: the send/recv "
                "rule"
            ),
            "all_to_all": (
                "outside: results equal what the grader computes from every rank's inputs; in-process: the send/recv "
                "rule"
            ),
            "process_groups": (
                "outside: results equal what the grader computes from every rank's inputs; in-process: the send/recv "
                "rule"
            ),
            "invalid_arguments": "in-process: exception types raised in the ranks",
        },
    ),
    Problem(
        id="parallel.ddp",
        title="Data parallelism with overlapped gradient all-reduce",
        hours=4,
        builds_on=("parallel.collectives",),
        learns="data parallelism that overlaps each gradient's all-reduce with the rest of backward",
        points={
            "broadcast_at_construction": 3,
            "matches_single_process": 8,
            "frozen_parameter": 3,
            "tied_weights": 3,
            "overlaps_backward": 3,
        },
        evidence={
            "broadcast_at_construction": (
                "outside: weights after DDP(model) equal those of rank 0, which only rank 0 received; in-process: the "
                "wrapper's .module is the model given"
            ),
            "matches_single_process": "outside: gradients and weights equal the grader's full-batch training",
            "frozen_parameter": "outside: training values; in-process: the count of all-reduces",
            "tied_weights": "outside: training values; in-process: the count of all-reduces",
            "overlaps_backward": (
                "in-process: recorded all-reduces, their phase, async flag and the phase of their wait"
            ),
        },
    ),
    Problem(
        id="parallel.ddp_bucketed",
        title="Data parallelism with gradient buckets",
        hours=4,
        builds_on=("parallel.ddp",),
        learns="why gradients travel in buckets, and how to send each bucket the moment its last gradient is ready",
        points={
            "matches_single_process": 8,
            "bucket_partition": 5,
            "overlaps_backward": 4,
            "speed": 3,
            "process_group": 2,
        },
        # Step time on two GPUs: (layers, width, rows per rank) of a stack of Linear + GELU layers.
        speed=SpeedThreshold(shapes=((8, 4096, 512),), dtypes=("float32",)),
        evidence={
            "matches_single_process": "outside: gradients and weights equal the grader's full-batch training",
            "bucket_partition": (
                "in-process: byte sizes of the recorded all-reduces; the wrapper's .module is the model given"
            ),
            "overlaps_backward": "in-process: recorded phases, async flags and the phases of their waits",
            "speed": "in-process: step times measured in the ranks, against the reference's ranks",
            "process_group": "outside: two groups of two ranks, each with its own weights and data, graded on values",
        },
    ),
    Problem(
        id="parallel.zero1",
        title="ZeRO-1: sharded optimizer state",
        hours=3,
        builds_on=("parallel.ddp",),
        learns="to shard the optimizer state across ranks and gather the updated parameters back",
        points={
            "matches_unsharded": 8,
            "state_sharded": 6,
            "process_group": 2,
        },
        evidence={
            "matches_unsharded": "outside: every rank's weights after each step equal the grader's training",
            "state_sharded": (
                "in-process: optimizer state bytes the rank reports, and the bytes its first step leaves alive (memory "
                "probe)"
            ),
            "process_group": "outside: each group's weights equal the grader's training",
        },
    ),
    Problem(
        id="parallel.zero2",
        title="ZeRO-2: sharded gradients and optimizer state",
        hours=4,
        builds_on=("parallel.zero1",),
        learns="to shard the gradients too, reducing each to the rank that owns it during backward",
        points={
            "matches_single_process": 8,
            "gradients_sharded": 5,
            "collective_pattern": 4,
            "process_group": 2,
        },
        evidence={
            "matches_single_process": "outside: owners' gradients need every rank's rows, weights need those of rank 0",
            "gradients_sharded": (
                "in-process: which gradients the rank reports as None, and the bytes backward and the reduces leave "
                "alive (memory probe); the wrapper's .module is the model given"
            ),
            "collective_pattern": "in-process: recorded collectives, their phases and the phases of their waits",
            "process_group": "outside: two groups of two ranks, each with its own weights and data, graded on values",
        },
    ),
    Problem(
        id="parallel.fsdp",
        title="Fully sharded data parallelism (ZeRO-3)",
        hours=8,
        builds_on=("parallel.zero2",),
        learns=(
            "fully sharded training: each unit's parameters gathered just in time and freed after, gradients "
            "reduce-scattered, bf16 compute"
        ),
        points={
            "matches_single_process": 8,
            "frozen_parameter": 2,
            "full_state_dict": 2,
            "tied_weights_rejected": 1,
            "collective_pattern": 3,
            "peak_parameter_memory": 4,
            "compute_dtype_bf16": 3,
            "speed": 3,
            "process_group": 2,
        },
        # Step time on two GPUs: (width, units, rows per rank), AdamW on bf16 compute.
        speed=SpeedThreshold(shapes=((4096, 4, 8192),), dtypes=("bfloat16",)),
        # bf16 compute: the student's error may be this multiple of the reference's own bf16 run's.
        bf16_error_multiple=8.0,
        evidence={
            "matches_single_process": "outside: gradient and weight shards equal the grader's training",
            "frozen_parameter": "outside: training values compared in the grader's process",
            "full_state_dict": "outside: the trained full state needs every rank's gradients and shards",
            "tied_weights_rejected": "in-process: what construction raised in the ranks",
            "collective_pattern": "in-process: recorded collectives, bytes and phases",
            "peak_parameter_memory": "in-process: memory probes inside the ranks",
            "compute_dtype_bf16": "outside: training values; in-process: the recorded collectives",
            "speed": "in-process: step times measured in the ranks, against the reference's ranks",
            "process_group": "outside: two groups of two ranks, each with its own weights and data, graded on values",
        },
    ),
    Problem(
        id="parallel.activation_checkpointing",
        title="Activation checkpointing",
        hours=3,
        learns="to trade compute for memory: recompute a block's activations in backward, with the same dropout masks",
        points={
            "matches_plain_block": 5,
            "inputs_without_grad": 2,
            "dropout_replays": 4,
            "saves_no_activations": 4,
        },
        call_timeout_s=60.0,
        world_sizes=(),
        budgets={"ci": 3, "public": 15, "grading": 60},
        # What a checkpointed forward may keep beyond its outputs, as a fraction of what the plain block keeps.
        held_fraction=0.25,
        evidence={
            "matches_plain_block": "outside: outputs and gradients compared in the grader's process",
            "inputs_without_grad": "outside: outputs and gradients compared in the grader's process",
            "dropout_replays": "outside: outputs and gradients compared in the grader's process",
            "saves_no_activations": "in-process: tensors saved for backward, recorded in the worker",
        },
    ),
    Problem(
        id="parallel.tensor_parallel",
        title="Tensor parallelism: column- and row-parallel layers, MLP and attention",
        hours=5,
        builds_on=("parallel.collectives",),
        learns=(
            "to split a block's weights across ranks with column- and row-parallel layers and one all-reduce each "
            "way"
        ),
        points={
            "column_parallel_linear": 3,
            "row_parallel_linear": 3,
            "mlp_matches_single_rank": 5,
            "attention_matches_single_rank": 5,
            "collective_pattern": 4,
            "invalid_arguments": 1,
            "process_group": 2,
        },
        evidence={
            "column_parallel_linear": "outside: the input gradient needs every rank's upstream shard",
            "row_parallel_linear": "outside: the output needs every rank's input shard",
            "mlp_matches_single_rank": (
                "outside: values (each rank holds the replicated input, so one rank could compute them)"
            ),
            "attention_matches_single_rank": (
                "outside: values (each rank holds the replicated input, so one rank could compute them)"
            ),
            "collective_pattern": "in-process: recorded collectives, bytes and phases",
            "invalid_arguments": "in-process: exception types raised in the ranks",
            "process_group": "outside: two groups of two ranks, each with its own weights and data, graded on values",
        },
    ),
    Problem(
        id="parallel.sequence_parallel",
        title="Sequence parallelism for the norm and dropout regions",
        hours=4,
        builds_on=("parallel.tensor_parallel",),
        learns=(
            "to split the norm and dropout regions along the sequence, turning the all-reduce into an all-gather "
            "and a reduce-scatter"
        ),
        points={
            "gather_and_reduce_scatter": 5,
            "block_matches_single_rank": 6,
            "dropout_matches_single_rank": 3,
            "collective_pattern": 4,
            "invalid_arguments": 1,
            "process_group": 2,
        },
        evidence={
            "gather_and_reduce_scatter": "outside: results need the other ranks' tensors; in-process: the call pattern",
            "block_matches_single_rank": "outside: parameter gradients sum over every rank's tokens",
            "dropout_matches_single_rank": "outside: parameter gradients sum over every rank's tokens",
            "collective_pattern": "in-process: recorded collectives, bytes and phases",
            "invalid_arguments": "in-process: exception types raised in the ranks",
            "process_group": "outside: two groups of two ranks, each with its own weights and data, graded on values",
        },
    ),
    Problem(
        id="parallel.pipeline",
        title="Pipeline parallelism with GPipe and 1F1B schedules",
        hours=6,
        builds_on=("parallel.collectives",),
        learns=(
            "to split the model into stages and schedule micro-batches through them: GPipe, 1F1B and the bubble "
            "they leave"
        ),
        points={
            "bubble_fraction": 2,
            "gpipe_matches_single_process": 5,
            "one_f_one_b_matches_single_process": 5,
            "gpipe_order": 2,
            "one_f_one_b_order": 4,
            "stages_overlap": 3,
            "invalid_arguments": 1,
            "process_group": 2,
        },
        evidence={
            "bubble_fraction": "outside: numbers compared in the grader's process",
            "gpipe_matches_single_process": (
                "outside: stage gradients, weights and loss need every stage's weights and data"
            ),
            "one_f_one_b_matches_single_process": (
                "outside: stage gradients, weights and loss need every stage's weights and data"
            ),
            "gpipe_order": "in-process: forward and backward order recorded by hooks in the ranks",
            "one_f_one_b_order": "in-process: forward and backward order recorded by hooks in the ranks",
            "stages_overlap": "in-process: step wall times measured in the ranks, over stages whose work is a sleep",
            "invalid_arguments": "in-process: exception types raised in the ranks",
            "process_group": "outside: two groups of two ranks, each with its own weights and data, graded on values",
        },
    ),
    Problem(
        id="parallel.expert_parallel",
        title="Expert parallelism with all_to_all dispatch and combine",
        hours=5,
        builds_on=("parallel.collectives", "moe.moe_layer"),
        learns="to place experts on different ranks and move tokens to them and back with all_to_all",
        points={
            "matches_single_rank": 8,
            "uneven_and_empty_experts": 5,
            "uses_all_to_all": 4,
            "invalid_arguments": 1,
            "process_group": 2,
        },
        budgets={"ci": 1, "public": 3, "grading": 8},
        evidence={
            "matches_single_rank": "outside: outputs and gradients need other ranks' experts and tokens",
            "uneven_and_empty_experts": "outside: outputs and gradients need other ranks' experts and tokens",
            "uses_all_to_all": "in-process: recorded collectives and bytes per phase",
            "invalid_arguments": "in-process: exception types raised in the ranks",
            "process_group": "outside: two groups of two ranks, each with its own weights and data, graded on values",
        },
    ),
    Problem(
        id="parallel.accounting",
        title="Memory and communication accounting",
        hours=3,
        builds_on=("parallel.fsdp", "parallel.sequence_parallel"),
        learns="to price a strategy before running it: memory per rank and bytes on the network",
        points={
            "bytes_per_parameter": 3,
            "communication_volume": 3,
            "activations": 2,
            "tensor_parallel_activations": 2,
            "sequence_parallel_activations": 2,
            "invalid_arguments": 1,
        },
        world_sizes=(),
        budgets={"ci": 25, "public": 100, "grading": 400},
        call_timeout_s=10.0,
        test_timeout_s=120.0,
        evidence={
            "bytes_per_parameter": "outside: numbers compared in the grader's process",
            "communication_volume": "outside: numbers compared in the grader's process",
            "activations": "outside: numbers compared in the grader's process",
            "tensor_parallel_activations": "outside: numbers compared in the grader's process",
            "sequence_parallel_activations": "outside: numbers compared in the grader's process",
            "invalid_arguments": "outside: numbers compared in the grader's process",
        },
    ),
    Problem(
        id="parallel.analysis",
        title="Analysis questions: parallel training",
        hours=3,
        builds_on=("parallel.ddp_bucketed", "parallel.pipeline", "parallel.accounting"),
        learns="to size a model's state per rank under each ZeRO stage, a pipeline's micro-batches and stashed "
        "activations, and a ring all-reduce's traffic, before running any of them, and to measure a pipeline's bubble "
        "and how gradient buckets trade latency against overlap",
        points={
            "zero_state": 3,
            "micro_batches_for_bubble": 2,
            "peak_micro_batches": 2,
            "ring_all_reduce_bytes": 2,
            "measured_bubble": 2,
            "measured_bucket_step_time": 2,
        },
        # The measured bubble runs the student's pipeline on 4 ranks (the bucket step time, bucketed DDP on 2).
        world_sizes=(4,),
        evidence={
            "zero_state": SHEET_EVIDENCE,
            "micro_batches_for_bubble": SHEET_EVIDENCE,
            "peak_micro_batches": SHEET_EVIDENCE,
            "ring_all_reduce_bytes": SHEET_EVIDENCE,
            "measured_bubble": "in-process: compared with the step times of your pipeline_step measured in its ranks",
            "measured_bucket_step_time": "in-process: compared with the step times of your BucketedDDP measured in its "
            "ranks",
        },
    ),
)

BY_ID: dict[str, Problem] = {p.id: p for p in PROBLEMS}


def problem_ids(text: str) -> list[str]:
    """The problem ids of a comma-separated list such as "kernels.softmax,moe.router" (the grader's --problem, the
    cluster's --problems); ValueError names any id the registry lacks."""
    ids = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [problem_id for problem_id in ids if problem_id not in BY_ID]
    if unknown:
        raise ValueError(f"unknown problem {', '.join(unknown)} (known: {', '.join(BY_ID)})")
    return ids


def problem_for_test_module(module_name: str) -> Problem | None:
    """The problem graded by the test module `grader.<family>.test_<name>` (None for any other module)."""
    family, _, stem = module_name.rpartition(".")
    for problem in PROBLEMS:
        if stem == f"test_{problem.name}" and family.endswith(f"grader.{problem.family}"):
            return problem
    return None
