"""The DeepSeek sparse attention reference on one GPU: attention over each query's top-k keys (forward, and forward
with backward) against dense causal attention of the same shape, with the indexer and the selection timed apart.

    python benchmarks/sparse_dsa.py [--backward-configs | --atomic-bound]

writes benchmarks/results/sparse_dsa.md. Shapes: batch 1, T = 8192 and 32768, topk = 2048, head size 128,
bfloat16, 16, 64 and 128 query heads sharing one key and one value per token (the MQA form DeepSeek runs it in). Dense
causal attention is the FlashAttention-2 reference of the kernels family and torch's own FlashAttention-2, both given
the keys and values repeated per head; it does T^2 / 2 score entries per head, the sparse kernels T topk, so the
ideal speed-up is T / (2 topk) (8 at T = 32768) and the forward's target is 5. The selection the sparse kernels are
timed on is each query's top-k of random scores; the indexer (8 heads of size 64) and select_topk are timed on their
own rows of the table. Times are medians of CUDA-event timings (triton.testing.do_bench); the backward is
torch.autograd.grad to q, k and v.

The backward adds every selected key's dK and dV rows with float32 atomics: 2 topk d adds per query and block of
heads, whatever the number of heads, against dense attention's work that grows with the heads. So the speed-up of
forward and backward grows with the heads and the length, and stays below the forward's: it has no target, since
even a free scatter would stop it at 5.2 or below (--atomic-bound).

--backward-configs times forward and backward at 64 heads, T = 32768 under each backward configuration of
BACKWARD_CONFIGS instead (the sweep behind the reference's `_backward_config`) and writes
benchmarks/results/sparse_dsa_backward_configs.md.

--atomic-bound times, at T = 32768 and each number of heads, the reference's forward and backward beside two
bounds made from its source (`bound_module`), both with wrong sums: the backward's atomic adds of dK and dV made plain
stores, the time if adding the rows cost no more than writing them; and the adds masked off entirely, the time if
the scatter of dK and dV cost nothing, the most any way of computing those two sums could save. Dense causal
attention's time beside them gives the speed-up each bound would reach. Writes
benchmarks/results/sparse_dsa_atomic_bound.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import itertools
import platform
import re
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch
import triton
import triton.testing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import config_sweep
from grader.attention.dsa_cases import causal_topk
from reference.attention import sparse_dsa as dsa_module
from reference.attention.sparse_dsa import indexer_scores, select_topk, sparse_attention
from reference.kernels.flash_attention_triton import flash_attention

BATCH, HEAD_DIM, TOPK = 1, 128, 2048
HEAD_COUNTS = (16, 64, 128)
LENGTHS = (8192, 32768)
INDEX_HEADS, INDEX_DIM = 8, 64
TARGET = 5.0  # dense causal time / sparse time at T = 32768, forward: the pass sparse attention speeds up in inference
DTYPE = torch.bfloat16
RESULTS = ROOT / "benchmarks" / "results" / "sparse_dsa.md"
# The backward's keys per loop step, warps and stages tried by --backward-configs, all heads in one program.
BACKWARD_HEADS = 64
BACKWARD_CONFIGS = [dict(BLOCK_H=BACKWARD_HEADS, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
                    for block_n, warps, stages in itertools.product((16, 32, 64), (4, 8), (1, 2, 3))]
BACKWARD_RESULTS = ROOT / "benchmarks" / "results" / "sparse_dsa_backward_configs.md"
ATOMIC_BOUND_RESULTS = ROOT / "benchmarks" / "results" / "sparse_dsa_atomic_bound.md"
# The backward's two float32 atomic adds, `tl.atomic_add(address, rows, mask=..., sem="relaxed")`.
ATOMIC_ADD = re.compile(r'tl\.atomic_add\((.*), sem="relaxed"\)')


def normal(*size, generator) -> torch.Tensor:
    return torch.randn(size, generator=generator, device="cuda", dtype=DTYPE)


def environment() -> str:
    """The GPU and the versions every results file names."""
    return (f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}, Python "
            f"{platform.python_version()}")


def milliseconds(call) -> float:
    return triton.testing.do_bench(call, warmup=5, rep=100, return_mode="median")


def forward_and_backward(function, tensors: list[torch.Tensor], backward: bool):
    def call():
        out = function(*tensors)
        if backward:
            torch.autograd.grad(out, tensors, torch.ones_like(out))
    return call


def torch_flash(q, k, v):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def sparse_inputs(seq: int, heads: int) -> tuple[torch.Tensor, ...]:
    """q, k, v (requiring gradients) and each query's top-k of random scores."""
    generator = torch.Generator(device="cuda").manual_seed(seq + heads)
    q = normal(BATCH, seq, heads, HEAD_DIM, generator=generator).requires_grad_(True)
    k, v = (normal(BATCH, seq, HEAD_DIM, generator=generator).requires_grad_(True) for _ in range(2))
    return q, k, v, causal_topk(torch.rand(BATCH, seq, seq, generator=generator, device="cuda"), TOPK)


def dense_inputs(q, k, v) -> list[torch.Tensor]:
    """Dense attention's [batch, heads, seq, head_dim] inputs: q's heads, the shared keys and values per head."""
    heads = q.shape[2]
    return [q.detach().transpose(1, 2).contiguous().requires_grad_(True),
            *(t.detach()[:, None].expand(-1, heads, -1, -1).contiguous().requires_grad_(True) for t in (k, v))]


def attention_rows(seq: int, heads: int) -> list[tuple]:
    """(pass, sparse ms, dense reference ms, torch flash ms) for forward and for forward with backward."""
    q, k, v, indices = sparse_inputs(seq, heads)
    dense = dense_inputs(q, k, v)
    rows = []
    for backward in (False, True):
        sparse_ms = milliseconds(forward_and_backward(lambda *t: sparse_attention(*t, indices), [q, k, v], backward))
        reference_ms = milliseconds(forward_and_backward(lambda *t: flash_attention(*t, is_causal=True), dense,
                                                         backward))
        torch_ms = milliseconds(forward_and_backward(torch_flash, dense, backward))
        rows.append(("fwd+bwd" if backward else "fwd", sparse_ms, reference_ms, torch_ms))
    return rows


def selection_ms(seq: int) -> tuple[float, float]:
    """(indexer_scores ms, select_topk ms) at `seq`."""
    generator = torch.Generator(device="cuda").manual_seed(seq)
    q_idx = normal(BATCH, seq, INDEX_HEADS, INDEX_DIM, generator=generator)
    k_idx = normal(BATCH, seq, INDEX_DIM, generator=generator)
    weights = normal(BATCH, seq, INDEX_HEADS, generator=generator)
    scores = indexer_scores(q_idx, k_idx, weights)
    return (milliseconds(lambda: indexer_scores(q_idx, k_idx, weights)),
            milliseconds(lambda: select_topk(scores, TOPK)))


def write_backward_configs() -> None:
    seq = LENGTHS[-1]
    q, k, v, indices = sparse_inputs(seq, BACKWARD_HEADS)
    timed = config_sweep.sweep(dsa_module, "_backward_config", BACKWARD_CONFIGS, lambda: milliseconds(
        forward_and_backward(lambda *t: sparse_attention(*t, indices), [q, k, v], backward=True)))
    BACKWARD_RESULTS.write_text("\n".join([
        "# DeepSeek sparse attention: backward configurations",
        "",
        f"{environment()}. Forward and backward, batch {BATCH}, {BACKWARD_HEADS} heads, T {seq}, head size "
        f"{HEAD_DIM}, topk {TOPK}, {DTYPE}; milliseconds, fastest first. Written by "
        "`python benchmarks/sparse_dsa.py --backward-configs`.",
        "",
        *config_sweep.table(timed, dsa_module._backward_config(DTYPE, BACKWARD_HEADS, HEAD_DIM)),
        "",
    ]))


def bound_module(folder: Path, name: str, rewrite) -> ModuleType:
    """The reference's sparse_dsa with each atomic add of its backward, `tl.atomic_add(<arguments>, sem=...)`, replaced
    by `rewrite(<arguments>)`, imported from a file in `folder` (triton.jit reads a kernel's source from its file)."""
    original = inspect.getsource(dsa_module)
    source, count = ATOMIC_ADD.subn(lambda match: rewrite(match.group(1)), original)
    if count != 2 or original.count("atomic_add(") != 2:
        raise RuntimeError(f"expected the backward's two atomic adds of dK and dV in {dsa_module.__file__}, found "
                           f"{count}: update ATOMIC_ADD")
    path = folder / f"sparse_dsa_{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"sparse_dsa_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def plain_store(arguments: str) -> str:
    return f"tl.store({arguments})"


def no_write(arguments: str) -> str:
    """The add with its mask false on every row: a row is added only where its key is valid, so at least 0, and this
    adds `key < 0`, which the compiler cannot see through (the keys are loaded)."""
    if arguments.count("mask=row_mask") != 1:
        raise RuntimeError(f"expected the atomic add's `mask=row_mask` in {arguments!r}: update no_write")
    never = "mask=row_mask & (keys[:, None] < 0)"
    return f'tl.atomic_add({arguments.replace("mask=row_mask", never)}, sem="relaxed")'


def write_atomic_bound() -> None:
    seq = LENGTHS[-1]
    lines = [
        "# DeepSeek sparse attention: what the backward's scatter of dK and dV costs",
        "",
        f"{environment()}. Forward and backward, batch {BATCH}, T {seq}, head size {HEAD_DIM}, topk "
        f"{TOPK}, {DTYPE}; milliseconds. Stores: dK and dV rows written with plain stores instead of float32 atomic "
        "adds. No writes: the adds masked off. Both bounds give wrong sums and do the same work otherwise. Dense: the "
        "FlashAttention-2 reference, causal, keys and values repeated per head. Written by "
        "`python benchmarks/sparse_dsa.py --atomic-bound`.",
        "",
        f"The scatter adds 2 topk head_dim float32 values per query and program of heads (up to "
        f"{dsa_module._heads_block(max(HEAD_COUNTS))} heads a program): "
        f"{2 * TOPK * HEAD_DIM * 4 * seq / 2**30:.0f} GiB at T {seq} for each program.",
        "",
        "| heads | reference | stores | no writes | dense | dense / reference | dense / stores | dense / no writes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as folder:
        bounds = [bound_module(Path(folder), name, rewrite)
                  for name, rewrite in (("store_bound", plain_store), ("no_write_bound", no_write))]
        for heads in HEAD_COUNTS:
            q, k, v, indices = sparse_inputs(seq, heads)
            sparse_ms = [milliseconds(forward_and_backward(
                lambda *t, attention=attention: attention(*t, indices), [q, k, v], backward=True))
                for attention in (sparse_attention, *(bound.sparse_attention for bound in bounds))]
            dense_ms = milliseconds(forward_and_backward(lambda *t: flash_attention(*t, is_causal=True),
                                                         dense_inputs(q, k, v), backward=True))
            lines.append(f"| {heads} | " + " | ".join(f"{ms:.2f}" for ms in (*sparse_ms, dense_ms)) + " | "
                         + " | ".join(f"{dense_ms / ms:.1f}" for ms in sparse_ms) + " |")
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    ATOMIC_BOUND_RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {ATOMIC_BOUND_RESULTS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backward-configs", action="store_true",
                        help="time the backward's configurations instead (see the module's docstring)")
    parser.add_argument("--atomic-bound", action="store_true",
                        help="time the backward with its atomic adds made stores, or masked off (see the docstring)")
    arguments = parser.parse_args()
    if arguments.backward_configs:
        write_backward_configs()
        return
    if arguments.atomic_bound:
        write_atomic_bound()
        return
    lines = [
        "# DeepSeek sparse attention: the reference against dense causal attention",
        "",
        f"{environment()}. Batch {BATCH}, head size {HEAD_DIM}, topk {TOPK}, {DTYPE}; keys and values "
        "shared by the heads (repeated per head for dense attention). Medians of triton.testing.do_bench.",
        "",
        f"Target at T = {LENGTHS[-1]}, forward: dense / sparse >= {TARGET} (ideal T / (2 topk) = "
        f"{LENGTHS[-1] / (2 * TOPK):g}). Forward and backward has none: with the backward's scatter of dK and dV "
        "masked off it would still stop at 5.2 or below (sparse_dsa_atomic_bound.md).",
        "",
        "| heads | T | pass | sparse ms | dense reference ms | dense / sparse | target met | torch flash ms | "
        "torch / sparse |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for heads in HEAD_COUNTS:
        for seq in LENGTHS:
            for name, sparse, dense, torch_ms in attention_rows(seq, heads):
                met = ("yes" if dense / sparse >= TARGET else "no") if (seq, name) == (LENGTHS[-1], "fwd") else ""
                lines.append(f"| {heads} | {seq} | {name} | {sparse:.2f} | {dense:.2f} | {dense / sparse:.1f} | "
                             f"{met} | {torch_ms:.2f} | {torch_ms / sparse:.1f} |")
                print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    lines += ["", f"The selection, apart: the indexer ({INDEX_HEADS} heads of size {INDEX_DIM}, float32 scores "
              "[batch, T, T]) and select_topk (torch.topk over int64 keys that break ties toward the lower key).", "",
              "| T | indexer_scores ms | select_topk ms |", "|---|---|---|"]
    for seq in LENGTHS:
        indexer, topk = selection_ms(seq)
        lines.append(f"| {seq} | {indexer:.2f} | {topk:.2f} |")
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
