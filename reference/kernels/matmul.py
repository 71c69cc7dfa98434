"""Tiled matrix multiplication C = A @ B in Triton with an optional fused GeLU, and the same math in plain PyTorch.

Each program computes one BLOCK_M x BLOCK_N tile of C in a float32 accumulator, walking K in BLOCK_K steps. Over the
whole launch the tiles read M*N*K*(1/BLOCK_N + 1/BLOCK_M) elements of A and B, against M*K + K*N distinct ones: every
A element is read once per column of tiles and every B element once per row of tiles. Launching the tiles grouped
(GROUP_M rows of tiles walked column by column) makes programs that run at the same time share their A row panels and
B column panels, so most of those re-reads hit L2 instead of HBM.

float32 inputs are multiplied in full float32 (`input_precision="ieee"`, on CUDA cores), not in TF32 on tensor cores:
the same numbers the interpreter computes and the same default as torch's own float32 matmul, so the tolerance stays
at float32 rounding. That costs speed: an H200's float32 FMA peak is about 67 TFLOP/s against about 495 for dense
TF32. float16 and bfloat16 inputs use the tensor cores, whose products are exact and whose sums are float32.
"""

import math

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Tiles are fixed per input width rather than autotuned: an autotuner keyed on (M, N, K) benchmarks every config
# again for each new shape, which is almost every call when shapes are drawn at random.
# 16-bit inputs: a 128x256 fp32 accumulator is 128 registers a thread at 8 warps; a stage of A and B tiles is 48 KiB
# of shared memory, so 3 stages (144 KiB) fit an H200 SM's 228 KiB. Against 128x128 tiles each loaded element feeds
# 1.5x the FLOPs (1/BLOCK_M + 1/BLOCK_N falls from 1/64 to 3/256); measured on an H200 at 4096^3 and 8192^3: 95-98%
# of torch.matmul, against 84-87% for 128x128. GROUP_M 16 keeps a wave's B panels shared by more programs.
TILES_16_BIT = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=16, num_warps=8, num_stages=3)
# float32 on CUDA cores: half the K depth keeps a stage at 32 KiB with 4-byte elements.
TILES_FLOAT32 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3)

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_CUBIC_COEFFICIENT = 0.044715
# The same constants for the kernel: a jitted function may read no global but a constexpr.
_SQRT_2_OVER_PI = tl.constexpr(SQRT_2_OVER_PI)
_GELU_CUBIC_COEFFICIENT = tl.constexpr(GELU_CUBIC_COEFFICIENT)


def _check_arguments(a, b, activation, allowed_dtypes: tuple[torch.dtype, ...]) -> None:
    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"matmul expects torch.Tensor inputs, got {type(x).__name__} for {name}")
        if x.dtype not in allowed_dtypes:
            raise TypeError(f"matmul supports dtypes {allowed_dtypes}, got {x.dtype} for {name}")
    if a.dtype != b.dtype:
        raise TypeError(f"matmul needs a and b of one dtype, got {a.dtype} and {b.dtype}")
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"matmul takes 2-D a and b, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul needs a.shape[1] == b.shape[0], got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if 0 in a.shape or 0 in b.shape:
        raise ValueError(f"matmul needs M, N, K >= 1, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"matmul needs a and b on one device, got {a.device} and {b.device}")
    if not (activation is None or (isinstance(activation, str) and activation == "gelu")):
        raise ValueError(f"matmul's activation must be None or 'gelu', got {activation!r}")


@triton.jit
def _grouped_tile(program, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Programs are numbered down the GROUP_M tile rows of a group first, then across its tile columns: a wave of
    # consecutive programs covers a near-square patch of C and so reads few distinct A rows and B columns.
    tile_rows = tl.cdiv(M, BLOCK_M)
    tile_cols = tl.cdiv(N, BLOCK_N)
    programs_per_group = GROUP_M * tile_cols
    first_tile_row = (program // programs_per_group) * GROUP_M
    # The last group may hold fewer than GROUP_M tile rows.
    rows_in_group = tl.minimum(tile_rows - first_tile_row, GROUP_M)
    index_in_group = program % programs_per_group
    return first_tile_row + index_in_group % rows_in_group, index_in_group // rows_in_group


@triton.jit
def _gelu_tanh(x):
    # 0.5 x (1 + tanh(u)) == x * sigmoid(2u) == x / (1 + exp(-2u)): one exp, no cancellation near tanh(u) = -1, and
    # an overflow of exp(-2u) or of x^3 still gives the right limit (x or -0) instead of NaN.
    u = _SQRT_2_OVER_PI * (x + _GELU_CUBIC_COEFFICIENT * x * x * x)
    return x / (1.0 + tl.exp(-2.0 * u))


@triton.jit
def _matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    a_stride_m,
    a_stride_k,
    b_stride_k,
    b_stride_n,
    c_stride_m,
    c_stride_n,
    APPLY_GELU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tile_row, tile_col = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = tile_row * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_col * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and columns past the edge wrap around to valid ones, so the loads need a mask along K only; their results
    # land in accumulator rows and columns that the store masks off. Offsets in int64: M * K may exceed 2**31.
    a_rows = (rows % M).to(tl.int64)
    b_cols = (cols % N).to(tl.int64)
    k_offsets = tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * a_stride_m + k_offsets[None, :] * a_stride_k
    b_ptrs = b_ptr + k_offsets[:, None] * b_stride_k + b_cols[None, :] * b_stride_n
    a_step = tl.cast(a_stride_k, tl.int64) * BLOCK_K
    b_step = tl.cast(b_stride_k, tl.int64) * BLOCK_K

    # Per step: BLOCK_M*BLOCK_K + BLOCK_K*BLOCK_N elements loaded for 2*BLOCK_M*BLOCK_N*BLOCK_K flops.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        # Zeros past K in both tiles: their products add exactly nothing to the sums.
        k_in_range = k_offsets < K - k_start
        a_tile = tl.load(a_ptrs, mask=k_in_range[None, :], other=0.0)
        b_tile = tl.load(b_ptrs, mask=k_in_range[:, None], other=0.0)
        # "ieee" only changes float32 operands (full float32 FMAs instead of TF32 tensor cores).
        acc = tl.dot(a_tile, b_tile, acc, input_precision="ieee")
        a_ptrs += a_step
        b_ptrs += b_step

    if APPLY_GELU:
        acc = _gelu_tanh(acc)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * c_stride_m + cols[None, :].to(tl.int64) * c_stride_n
    in_bounds = (rows[:, None] < M) & (cols[None, :] < N)
    # The one rounding to the output dtype, after the epilogue.
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=in_bounds)


def _with_a_unit_stride(x: torch.Tensor) -> torch.Tensor:
    # With no unit-stride dimension every tile load is a gather of scattered elements, repeated by every program that
    # reads the tile; one copy (a read and a write of x) costs less.
    return x if 1 in x.stride() else x.contiguous()


def matmul(a: torch.Tensor, b: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """C = A @ B (A [M, K], B [K, N], any strides, float32/float16/bfloat16), accumulated in float32, optionally with
    the tanh GeLU applied to the float32 accumulator before the one rounding to the input dtype."""
    _check_arguments(a, b, activation, SUPPORTED_DTYPES)
    a = _with_a_unit_stride(a)
    b = _with_a_unit_stride(b)
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    tiles = TILES_FLOAT32 if a.dtype == torch.float32 else TILES_16_BIT
    grid = (triton.cdiv(M, tiles["BLOCK_M"]) * triton.cdiv(N, tiles["BLOCK_N"]),)
    _matmul_kernel[grid](
        a,
        b,
        c,
        M,
        N,
        K,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        APPLY_GELU=activation == "gelu",
        **tiles,
    )
    return c


def matmul_torch(a: torch.Tensor, b: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """The same product and GeLU in plain PyTorch, computed in the inputs' own dtype (float64 too), with the same
    argument checks."""
    _check_arguments(a, b, activation, SUPPORTED_DTYPES + (torch.float64,))
    c = a @ b
    if activation == "gelu":
        c = 0.5 * c * (1.0 + torch.tanh(SQRT_2_OVER_PI * (c + GELU_CUBIC_COEFFICIENT * c**3)))
    return c.contiguous()
