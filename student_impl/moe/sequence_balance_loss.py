"""The sequence-wise auxiliary balance loss of DeepSeek-V3, for sigmoid-affinity routers."""

from __future__ import annotations

from torch import Tensor


def sequence_balance_loss(affinity_logits_BTE: Tensor, expert_index_BTK: Tensor, alpha: float) -> Tensor:
    """The balance loss of B sequences of T tokens routed to k of E experts each, averaged over the sequences.

    Arguments:
        affinity_logits_BTE: the router's affinity logits, [B, T, E], a floating dtype (float32, float16 or
            bfloat16). The affinity of token t for expert i is s_(t,i) = sigmoid(affinity_logits_BTE[b, t, i]).
        expert_index_BTK: int64 [B, T, k], the k experts each token was routed to (chosen by whatever rule the
            router uses, possibly with a selection bias; the loss only counts them). Every entry is in [0, E);
            1 <= k <= E. The experts of one token are normally distinct, but the loss does not require it: it
            counts every (token, slot) entry.
        alpha: the loss weight, a Python float >= 0.

    Computation (all in float32, whatever the input dtype), separately for each sequence b:
        s'_(t,i) = s_(t,i) / sum_j s_(t,j)                  the normalised affinities of token t (sum to 1)
        P_i      = (1 / T) * sum_t s'_(t,i)                  mean over the sequence's T tokens
        f_i      = E / (k * T) * count_i, where count_i is the number of entries of expert_index_BTK[b] equal
                   to i (so f_i = 1 for every expert when the sequence's T * k slots are spread evenly)
        L_b      = alpha * sum_i f_i * P_i
    and the result is the mean of L_b over the B sequences: (1 / B) * sum_b L_b. The statistics are per sequence:
    pooling the B * T tokens into one f and one P gives a different, batch-wise loss.

    Returns: a float32 0-d tensor on the device of the inputs.

    Gradients: the loss is differentiable with respect to affinity_logits_BTE through P only (the counts carry no
    gradient); the gradient arrives in the logits' dtype.

    Raises:
        TypeError: if affinity_logits_BTE is not floating or expert_index_BTK is not int64.
        ValueError: if either input is not 3-D, their B or T differ, B == 0, T == 0, k is not in [1, E], an
            expert index is outside [0, E), or alpha < 0.
    """
    raise NotImplementedError
