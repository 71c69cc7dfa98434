"""DeepSeek sparse attention (DeepSeek-V3.2): a lightning indexer scores every past key of each query, the query
keeps its top-k keys, and attention runs over those keys only.

Three functions, each graded on its own, and their composition (given):
    indexer_scores(q_idx, k_idx, weights) -> scores     the indexer, torch or Triton
    select_topk(scores, topk) -> indices                the selection, torch
    sparse_attention(q, k, v, indices) -> o             attention over the selected keys, Triton, with backward
The key and value of a token are shared by every attention head (DeepSeek runs this on MLA in MQA form), so a
selected key row serves all heads of its query at once.
"""

import torch
import triton
import triton.language as tl


def indexer_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The lightning indexer's scores of every key s for every query t.

    For each batch b, with j over the index_heads indexer heads:
        scores[b, t, s] = sum_j weights[b, t, j] * relu(q_idx[b, t, j] . k_idx[b, s])   for s <= t
        scores[b, t, s] = -inf                                                          for s > t
    No scale beyond the weights. If you read DeepSeek-V3.2's code or fla: they scale these scores (DeepSeek's code
    multiplies the weights by 1 / sqrt(index_heads * index_dim)); here the weights are used as given, and a scaled
    score is out of tolerance. Products are summed in float32 or wider (convert the inputs, or accumulate a
    `tl.dot` in float32). Any torch operator may be used here, or a Triton kernel; a [batch, seq, index_heads, seq]
    intermediate is allowed but grows fast (loop over the indexer heads instead).

    Args:
        q_idx: [batch, seq, index_heads, index_dim], the indexer's queries (index_heads >= 1).
        k_idx: [batch, seq, index_dim], one indexer key per token, shared by the indexer heads.
        weights: [batch, seq, index_heads], each query's weight per indexer head (any sign).
        One dtype, float32, float16 or bfloat16; index_dim a multiple of 16 from 16 to 128; one device.

    Returns:
        scores, a new float32 tensor [batch, seq, seq] on the inputs' device.

    Raises:
        TypeError: an argument is not a torch.Tensor, not float32/float16/bfloat16, or the dtypes differ.
        ValueError: q_idx is not 4-D, k_idx or weights do not match it (shapes above), a dimension is 0,
            index_dim is not a multiple of 16 from 16 to 128, or the tensors are on different devices.
    """
    raise NotImplementedError


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Each query's topk highest-scoring keys among s <= t.

    Pinned:
        - Only keys s <= t are candidates; what scores holds above the diagonal is ignored, whatever it is.
        - Query t has t + 1 candidates: when t + 1 < topk it keeps all of them.
        - Equal scores keep the lower key index first (as the MoE router's top-k): among candidates with equal
          scores, a lower s is taken before a higher one.
        - Each row lists its keys in ascending order, then -1 in every slot left (at the row's end).
    If you read DeepSeek-V3.2's code: it keeps torch.topk's order (highest score first) and fills a row with fewer
    than topk candidates with future keys, which its attention masks later; here the row is sorted by key index and
    padded with -1, and the indices are compared exactly: the scores decide which keys, never their order.
    Any torch operator may be used (torch.topk does not promise an order among equal values; a stable sort does).

    Args:
        scores: float32 [batch, seq, seq], finite wherever s <= t.
        topk: a Python int >= 1 (not a bool), possibly larger than seq.

    Returns:
        indices, a new int64 tensor [batch, seq, topk] on scores' device.

    Raises:
        TypeError: scores is not a float32 torch.Tensor, or topk is not an int (a bool is not).
        ValueError: scores is not [batch, seq, seq], a dimension is 0, or topk < 1.
    """
    raise NotImplementedError


class SparseAttentionFunction(torch.autograd.Function):
    """The autograd function behind `sparse_attention`; see its docstring for the math and conventions.

    forward(ctx, q, k, v, indices) -> o
        Launches your Triton forward kernel: a program per query (and batch, and block of heads) gathers the key
        and value rows its indices name, block by block, computes the scores of all its heads against each
        gathered block with one tl.dot, and runs the online softmax over the blocks. It calls exactly
        `ctx.save_for_backward(q, k, v, o, L, indices)` (L: float32 [batch, seq, heads], natural logarithm) and
        keeps nothing else on ctx.

    backward(ctx, grad_o) -> (dq, dk, dv, None)
        Launches your Triton kernels, rebuilding P = exp(S - L) from the saved L. A key row selected by many
        queries receives the sum of their contributions: accumulate dK and dV in float32 with `tl.atomic_add`
        (allowed here; the order of the sums may vary), then round them to the input dtype in a kernel. The
        None is indices'.

    Work: with topk fixed, every kernel's work grows linearly in seq: a key no query selected is never loaded
    for that query (the grader counts the lanes your kernels load, masked lanes included, at three lengths; on
    a GPU it times them). No tensor with two dimensions of length seq; no block of any kernel longer than 128
    along a dimension.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The forward pass by your Triton kernel: returns o and saves (q, k, v, o, L, indices)."""
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad_o: torch.Tensor):
        """The backward pass by your Triton kernels: returns (dq, dk, dv, None)."""
        raise NotImplementedError


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Attention of each query over the keys its row of `indices` names; returns SparseAttentionFunction.apply(...).

    For each batch b and query t, with S_t the entries of indices[b, t] that are not -1, h a head, d = head_dim
    and s = 1 / sqrt(d):
        L[b, t, h] = log sum_{j in S_t} exp(s q[b, t, h] . k[b, j])         (natural logarithm)
        o[b, t, h] = sum_{j in S_t} exp(s q[b, t, h] . k[b, j] - L[b, t, h]) v[b, j]
    The indices may name any key, in any order, with -1 in any slot (skipped): causality is the selection's
    job, not this function's. Every row names at least one key and no key twice; the indices are not checked
    (reading them in Python or torch would be computing outside your kernels). The library attention and
    softmax (scaled_dot_product_attention, flex_attention, torch.softmax and their aliases) must not be used;
    beyond allocating, viewing and copying tensors, torch may not compute here (handout: "Do the work
    yourself").

    Args:
        q: [batch, seq, heads, head_dim], any heads >= 1.
        k, v: [batch, seq, head_dim], one key and one value per token, shared by every head.
        indices: int64 [batch, seq, topk], topk >= 1, entries in [0, seq) or -1.
        q, k and v share one dtype, float32, float16 or bfloat16, and any strides; head_dim a multiple of 16 from
        16 to 128 (pad to the next power of two with masks). On a CUDA device, or on the CPU under Triton's
        interpreter (TRITON_INTERPRET=1).

    Returns:
        o, a new contiguous tensor with q's shape, dtype and device, accumulated in float32 and rounded once.
        For float32 inputs every `tl.dot` multiplies at full precision (`input_precision="ieee"`); for float16
        and bfloat16, P and dS may be rounded to the input dtype just before the `tl.dot` that consumes them.

    Raises (checked before any kernel is launched):
        TypeError: q, k or v is not a torch.Tensor or not float32, float16 or bfloat16, their dtypes differ, or
            indices is not an int64 torch.Tensor.
        ValueError: q is not 4-D, k or v is not [batch, seq, head_dim] of q's sizes, indices is not
            [batch, seq, topk] with topk >= 1, a dimension is 0, head_dim is not a multiple of 16 from 16 to 128,
            or the tensors are on different devices.
    """
    raise NotImplementedError


def deepseek_sparse_attention(q, k, v, q_idx, k_idx, weights, topk: int) -> torch.Tensor:
    """Given: the indexer's scores, their top-k, then attention over the selected keys. The selection is not
    differentiable: no gradient reaches q_idx, k_idx or weights (training the indexer is out of scope)."""
    with torch.no_grad():
        indices = select_topk(indexer_scores(q_idx, k_idx, weights), topk)
    return sparse_attention(q, k, v, indices)
