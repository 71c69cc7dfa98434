"""Causal linear attention (feature map elu + 1, no normaliser): two plain PyTorch forms and a chunked Triton form."""

import torch
import triton
import triton.language as tl


def linear_attention_parallel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal linear attention as the masked quadratic form, in plain PyTorch.

    o = (phi(Q) phi(K)^T * M) V for each batch and head, with phi(x) = elu(x) + 1 applied elementwise to q and k by
    this function, and M the causal mask (M[i, j] = 1 iff j <= i). This is the only one of the three forms allowed
    to build the T x T matrix of scores. Conventions, arguments, result and errors: as `linear_attention_chunked`.
    """
    raise NotImplementedError


def linear_attention_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal linear attention as the recurrence, in plain PyTorch: a Python loop over the tokens t = 0 .. T-1.

    A float32 state of shape [batch, heads, K, V] starts at zero; at each t it first takes the token in,
    S <- S + phi(k_t) v_t^T, then gives o_t = S^T phi(q_t) (so token t sees itself). Conventions, arguments, result
    and errors: as `linear_attention_chunked`.
    """
    raise NotImplementedError


class LinearAttentionFunction(torch.autograd.Function):
    """The autograd function behind `linear_attention_chunked`; see its docstring for the math and the conventions.

    forward(ctx, q, k, v, chunk_size) -> o
        Launches your Triton kernels for the chunked form. The tokens are cut into N = ceil(T / C) chunks of
        C = chunk_size (the last one may be shorter: mask it). With Q' = phi(Q), K' = phi(K) and S_c the
        state before chunk c (the sum of phi(k_j) v_j^T over the tokens of the earlier chunks; S_0 = 0), the
        outputs of chunk c are
            O_c = Q'_c S_c + (Q'_c K'_c^T * M) V_c,
        the masked quadratic form inside the chunk plus the contribution of everything before it. A sensible split:
        one kernel computes the chunk-boundary states S_0 .. S_{N-1} (one program per batch*head and block of the
        [K, V] state, walking the chunks in order), another the outputs (one program per chunk and batch*head, in
        parallel). Torch may only allocate, view and copy tensors here (torch.empty, zeros, ones, full, view,
        reshape, transpose, permute, expand, contiguous, clone, copy_, .to, slicing, ...): all arithmetic, phi
        included, happens in your kernels, and no value may be read back into Python (.item(), .tolist()). It may
        save for backward (ctx.save_for_backward) the inputs and the chunk-boundary states, nothing else (or save
        only the inputs and recompute the states); plain Python values (chunk_size, say) may be kept on ctx.

    backward(ctx, grad_o) -> (dq, dk, dv, None)
        With dS_c the sum of Q'_j^T dO_j over the tokens of the later chunks (dS_{N-1} = 0), A = Q'_c K'_c^T * M and
        dA = dO_c V_c^T * M:
            dQ'_c = dO_c S_c^T + dA K'_c,    dK'_c = V_c dS_c^T + dA^T Q'_c,    dV_c = K'_c dS_c + A^T dO_c,
        and dq = dQ' * phi'(q), dk = dK' * phi'(k), where phi'(x) = 1 for x > 0 and exp(x) otherwise. Your choice:
        Triton kernels (a pass over the chunks in reverse for dS, then one parallel kernel over the chunks), or
        plain PyTorch that is itself chunked (loops over chunks, never over tokens). grad_o may have any strides
        (a stride of 0 too, as when o.sum() is differentiated). The gradients have the shapes and dtypes of q, k, v;
        the None is chunk_size's.

    Neither pass may build a tensor with two dimensions of length T (a score or mask matrix of all token pairs),
    nor a stack of per-token states: at most ceil(T / C) + 1 states of shape [K, V] per (batch, head) in any tensor.
    The forward's kernels, and the backward's if you write it in Triton, must read their inputs and write their
    outputs themselves (the grader records the memory traffic of every kernel launched). No block in any of your
    kernels (a Triton tensor of two or more dimensions) may be longer than 128 along any dimension. Each pass makes
    at most 4 Triton launches per chunk plus 8 (a launch per chunk is slow but allowed; a launch per token is the
    recurrence, not the chunked form).
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """The forward pass by your Triton kernels: returns o and saves the inputs (and the boundary states)."""
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad_o: torch.Tensor):
        """The backward pass, by Triton kernels or chunked PyTorch: returns (dq, dk, dv, None)."""
        raise NotImplementedError


def linear_attention_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """Causal linear attention by your chunked Triton kernels; checks its arguments (see Raises), then returns
    `LinearAttentionFunction.apply(q, k, v, chunk_size)`.

    For each batch b and head h, with phi(x) = elu(x) + 1 (x + 1 for x > 0, exp(x) otherwise) applied elementwise to
    q and k by this function (the caller passes raw q and k, and has already scaled q if it wants a scale: none is
    applied here):
        S_t = S_{t-1} + phi(k_t) v_t^T    (S_{-1} = 0, a [K, V] state)
        o_t = S_t^T phi(q_t)              (token t included)
    equivalently o = (phi(Q) phi(K)^T * M) V with M[i, j] = 1 iff j <= i. There is no normaliser (no division by
    phi(q_t) . sum_j phi(k_j)): the handout says why. The result must not depend on chunk_size beyond rounding.
    The library attention and softmax (torch.nn.functional.scaled_dot_product_attention, torch.softmax and their
    aliases) must not be used, here or in the other two forms.

    Args:
        q, k: [batch, heads, seq, K]; v: [batch, heads, seq, V]. K and V each one of 16, 32, 64, 128 (they may
            differ). Any batch, heads >= 1 and any seq >= 1, not necessarily a multiple of chunk_size. One dtype,
            float32, float16 or bfloat16; one device: a CUDA device, or the CPU when Triton's interpreter is on
            (TRITON_INTERPRET=1; the two PyTorch forms run on any device). Any strides (e.g. views of
            [batch, seq, heads, dim] tensors, or of one packed tensor): pass them to your kernels, or make copies.
        chunk_size: C, the tokens per chunk: 16, 32 or 64.

    Returns:
        o, a new tensor [batch, heads, seq, V] with q's dtype and device. Every product and sum accumulates in
        float32 whatever the input dtype (phi too is computed in float32), and o is rounded to q's dtype once, at
        the end. For float32 inputs, every `tl.dot` must multiply at full float32 precision
        (`input_precision="ieee"`): the default TF32 keeps 10 mantissa bits and misses the float32 tolerance on a
        GPU. For float16 and bfloat16 inputs, the operands of a `tl.dot` (phi(q), phi(k), the masked scores, a
        state) may be rounded to the input dtype just before it; the sums stay float32.

    Outputs and gradients (through LinearAttentionFunction.backward) are compared with the recurrence computed at
    float64.

    Raises (checked before any computation or kernel launch, by all three forms alike):
        TypeError: q, k or v is not a torch.Tensor, or has a dtype other than float32, float16 and bfloat16, or
            their dtypes differ.
        ValueError: q, k or v is not 4-D; batch, heads or seq differ between q, k and v; k's last dimension differs
            from q's; a dimension has size 0; K or V is not one of 16, 32, 64, 128; q, k and v are on different
            devices; (chunked form) chunk_size is not one of the ints 16, 32, 64.
    """
    raise NotImplementedError
