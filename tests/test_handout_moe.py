"""The mixture-of-experts chapter of the handout: every worked example and self-check answer it prints, recomputed.

The MoE layer's section (assignment/handout/sections/moe/moe_layer.typ) is checked formula by formula: the forward
as its algorithm box writes it (stable sort, counts, gather, one SwiGLU per slice, inverse permutation, gated sum)
and the backward as its gradient section writes it (gate and output gradients of the combine, the renormalisation,
the softmax, the SwiGLU of each slice, the scatter-add back to the tokens), in float64, against the reference's
plain `moe_layer_torch` and its autograd; the FLOP formula by counting the products of that forward and of that
backward; the worked example's dispatch arrays and the cost figures printed for the speed test's shape. For every
router of the chapter the worked routing decision is run through the reference's own function and its printed
indices, gates, counts and losses are compared; so are the numeric answers of every section's self-check.
"""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from reference.moe.accounting import parameter_counts
from reference.moe.bias_balancing import update_expert_bias
from reference.moe.capacity import apply_capacity
from reference.moe.expert_choice import expert_choice_route
from reference.moe.group_limited_routing import group_limited_route
from reference.moe.moe_layer import moe_layer, moe_layer_torch
from reference.moe.noisy_topk import noisy_topk_route
from reference.moe.router import topk_route
from reference.moe.sequence_balance_loss import sequence_balance_loss
from reference.moe.sigmoid_router import sigmoid_route
from reference.moe.upcycle import upcycle

F32, F64 = torch.float32, torch.float64


def close(values, printed, digits):
    """The values are the printed numbers, to the digits printed."""
    values = torch.as_tensor(values, dtype=F64).flatten().tolist()
    printed = torch.as_tensor(printed, dtype=F64).flatten().tolist()
    assert len(values) == len(printed)
    for value, shown in zip(values, printed):
        assert abs(value - shown) <= 0.5 * 10**-digits + 1e-9, (value, shown)


def logit(p):
    """The logit whose sigmoid is p."""
    p = torch.as_tensor(p, dtype=F64)
    return torch.log(p / (1 - p))


# --- the MoE layer: forward and backward as the section writes them ------------------------------------------------


def layer_weights(tokens, width, hidden, experts, shared, shared_hidden, seed):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(tokens, width, generator=gen, dtype=F64),
        router=torch.randn(experts, width, generator=gen, dtype=F64),
        gate=torch.randn(experts, hidden, width, generator=gen, dtype=F64) / width**0.5,
        up=torch.randn(experts, hidden, width, generator=gen, dtype=F64) / width**0.5,
        down=torch.randn(experts, width, hidden, generator=gen, dtype=F64) / hidden**0.5,
        shared_gate=torch.randn(shared, shared_hidden, width, generator=gen, dtype=F64) / width**0.5,
        shared_up=torch.randn(shared, shared_hidden, width, generator=gen, dtype=F64) / width**0.5,
        shared_down=torch.randn(shared, width, shared_hidden, generator=gen, dtype=F64) / shared_hidden**0.5,
    )


ORDER = ("x", "router", "gate", "up", "down", "shared_gate", "shared_up", "shared_down")


def route(x, router, k, normalize):
    """Softmax probabilities, top-k by (probability descending, index ascending), gates (renormalised or not)."""
    probs = torch.softmax(x @ router.T, dim=-1)
    experts = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    chosen = probs.gather(1, experts)
    gates = chosen / chosen.sum(-1, keepdim=True) if normalize else chosen
    return probs, experts, chosen, gates


def dispatch(experts_tk, num_experts):
    """Algorithm 1, step 2 and the inverse of step 5: order, counts, slice ends, inverse."""
    flat = experts_tk.flatten()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    ends = torch.cumsum(counts, 0)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return flat, order, counts, ends, inverse


class Products:
    """a @ b, counting 2 m n p FLOPs for an [m, n] by [n, p] product."""

    def __init__(self):
        self.flops = 0

    def __call__(self, a, b):
        self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return a @ b


def plain(a, b):
    return a @ b


def swiglu(x, gate, up, down, mm=plain):
    return mm(F.silu(mm(x, gate.T)) * mm(x, up.T), down.T)


def layer_forward(w, k, normalize=True, mm=plain):
    """Algorithm 1 as the box writes it: route, sort, gather, one SwiGLU per slice, inverse, gated sum (+ shared)."""
    x = w["x"]
    tokens, width = x.shape
    probs = torch.softmax(mm(x, w["router"].T), dim=-1)
    experts = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    gates = probs.gather(1, experts)
    gates = gates / gates.sum(-1, keepdim=True) if normalize else gates
    _, order, counts, _, inverse = dispatch(experts, w["router"].shape[0])
    x_sorted = x[order // k]
    outputs = [swiglu(rows, *weights, mm=mm) for rows, weights in
               zip(x_sorted.split(counts.tolist()), zip(w["gate"], w["up"], w["down"])) if rows.shape[0] > 0]
    out = torch.cat(outputs)[inverse].view(tokens, k, width)
    y = (gates[..., None] * out).sum(1)
    for weights in zip(w["shared_gate"], w["shared_up"], w["shared_down"]):
        y = y + swiglu(x, *weights, mm=mm)
    return y


def silu_grad(z):
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def swiglu_backward(x, gate, up, down, d_out, mm=plain):
    """dW_d = dO^T h, dh = dO W_d, da = dh . u . silu'(a), du = dh . silu(a), dW_g = da^T X, dW_u = du^T X,
    dX = da W_g + du W_u. `mm` does the gradient's products (the forward's are recomputed apart)."""
    a, u = x @ gate.T, x @ up.T
    h = F.silu(a) * u
    d_h = mm(d_out, down)
    d_a, d_u = d_h * u * silu_grad(a), d_h * F.silu(a)
    return mm(d_a, gate) + mm(d_u, up), mm(d_a.T, x), mm(d_u.T, x), mm(d_out.T, h)


def layer_backward(w, k, d_y, mm=plain):
    """The gradients section: the combine, the renormalisation and softmax, each slice's SwiGLU, the scatter-add."""
    x, router = w["x"], w["router"]
    tokens, width = x.shape
    num_experts = router.shape[0]
    probs, experts, chosen, gates = route(x, router, k, True)
    _, order, counts, _, inverse = dispatch(experts, num_experts)
    x_sorted = x[order // k]
    slices = x_sorted.split(counts.tolist())
    out_sorted = torch.cat([swiglu(rows, *weights) if rows.shape[0] else rows.new_zeros(0, width)
                            for rows, weights in zip(slices, zip(w["gate"], w["up"], w["down"]))])
    out = out_sorted[inverse].view(tokens, k, width)
    # The combine: dL/dg = dy . o, dL/do = g dy.
    d_gates = (d_y[:, None, :] * out).sum(-1)
    d_out = gates[..., None] * d_y[:, None, :]
    # The renormalisation: dp_j = (dg_j - sum_j' g_j' dg_j') / sum_j' p_j', then the softmax and the logits.
    d_chosen = (d_gates - (gates * d_gates).sum(-1, keepdim=True)) / chosen.sum(-1, keepdim=True)
    d_probs = torch.zeros_like(probs).scatter(1, experts, d_chosen)
    d_logits = probs * (d_probs - (probs * d_probs).sum(-1, keepdim=True))
    grads = dict(router=mm(d_logits.T, x))
    d_x = mm(d_logits, router)
    # Back through the inverse permutation: the gated gradients land in the same slices.
    d_out_sorted = d_out.reshape(tokens * k, width)[order]
    d_x_sorted, d_gate, d_up, d_down = [], [], [], []
    for rows, d_rows, weights in zip(slices, d_out_sorted.split(counts.tolist()),
                                     zip(w["gate"], w["up"], w["down"])):
        d_rows_x, dg, du, dd = swiglu_backward(rows, *weights, d_rows, mm=mm)
        d_x_sorted.append(d_rows_x)
        d_gate.append(dg)
        d_up.append(du)
        d_down.append(dd)
    # The permute read token t's row k times: its backward is a scatter-add.
    d_x = d_x.index_add(0, order // k, torch.cat(d_x_sorted))
    grads.update(gate=torch.stack(d_gate), up=torch.stack(d_up), down=torch.stack(d_down))
    d_shared = [swiglu_backward(x, *weights, d_y, mm=mm) for weights in zip(w["shared_gate"], w["shared_up"],
                                                                      w["shared_down"])]
    for d_rows_x, *_ in d_shared:
        d_x = d_x + d_rows_x
    grads.update(shared_gate=torch.stack([d[1] for d in d_shared]), shared_up=torch.stack([d[2] for d in d_shared]),
                 shared_down=torch.stack([d[3] for d in d_shared]))
    grads["x"] = d_x
    return grads


def skewed(w):
    """Router rows that send every token to experts 0 and 1 first: the other experts are idle."""
    w = dict(w)
    w["x"] = w["x"].clone()
    w["x"][:, 0] += 4.0
    router = w["router"].clone() * 0.1
    router[0, 0] += 3.0
    router[1, 0] += 2.0
    w["router"] = router
    return w


@pytest.mark.parametrize("k, shared, skew", [(2, 2, False), (3, 0, False), (2, 1, True)])
def test_layer_forward_as_the_algorithm_box_writes_it(k, shared, skew):
    w = layer_weights(tokens=12, width=6, hidden=5, experts=5, shared=shared, shared_hidden=4, seed=k + shared)
    w = skewed(w) if skew else w
    expected = moe_layer_torch(*(w[name] for name in ORDER), k)
    assert torch.allclose(layer_forward(w, k), expected, atol=1e-12)
    # The fast reference routes in float32 even for float64 inputs, hence the looser tolerance.
    assert torch.allclose(moe_layer(*(w[name] for name in ORDER), k), expected, atol=1e-5)


@pytest.mark.parametrize("skew", [False, True])
def test_layer_gradients_as_the_section_derives_them(skew):
    k = 2
    w = layer_weights(tokens=10, width=6, hidden=5, experts=5, shared=2, shared_hidden=3, seed=7)
    w = skewed(w) if skew else w
    leaves = {name: tensor.clone().requires_grad_() for name, tensor in w.items()}
    d_y = torch.randn(10, 6, generator=torch.Generator().manual_seed(8), dtype=F64)
    y = moe_layer_torch(*(leaves[name] for name in ORDER), k)
    autograd = dict(zip(ORDER, torch.autograd.grad(y, [leaves[name] for name in ORDER], d_y)))
    derived = layer_backward(w, k, d_y)
    for name in ORDER:
        assert torch.allclose(derived[name], autograd[name], atol=1e-10), name
    if skew:  # an expert with no rows sums over none: exactly zero weight gradients
        _, experts, _, _ = route(w["x"], w["router"], k, True)
        idle = sorted(set(range(5)) - set(experts.flatten().tolist()))
        assert idle
        for e in idle:
            assert not derived["gate"][e].any() and not derived["down"][e].any()


def test_forward_flops_and_three_times_that_with_the_backward():
    tokens, width, hidden, experts, k, shared, shared_hidden = 16, 8, 6, 4, 2, 2, 5
    w = layer_weights(tokens, width, hidden, experts, shared, shared_hidden, seed=3)
    forward = 6 * tokens * k * width * hidden + 6 * tokens * shared * width * shared_hidden \
        + 2 * tokens * width * experts
    counter = Products()
    layer_forward(w, k, mm=counter)
    assert counter.flops == forward
    # The derived backward: two products of the same size for each of the forward's.
    counter = Products()
    layer_backward(w, k, torch.ones(tokens, width, dtype=F64), mm=counter)
    assert counter.flops == 2 * forward
    # Every expert on every token instead: E / k times the routed products. The count is linear in k, so the
    # products that do not depend on it (router, shared experts) are 2 c(1) - c(2).
    counts = {}
    for top in (1, 2, experts):
        counter = Products()
        layer_forward(w, top, mm=counter)
        counts[top] = counter.flops
    fixed = 2 * counts[1] - counts[2]
    assert counts[experts] - fixed == experts // k * (counts[k] - fixed)


def test_speed_shape_costs_printed_in_the_section():
    tokens, experts, k, width, hidden, shared, b = 16384, 64, 6, 2048, 1408, 2, 2

    def uniform_rows(tokens):
        """Rows per expert when routing is uniform: token t to experts t k, ..., t k + k - 1 (mod E)."""
        chosen = (torch.arange(tokens)[:, None] * k + torch.arange(k)) % experts
        return set(torch.bincount(chosen.flatten(), minlength=experts).tolist())

    def expert_flops(rows):
        """torch's count of one expert's SwiGLU products on `rows` rows (meta tensors)."""
        x = torch.empty(rows, width, device="meta", dtype=torch.bfloat16)
        gate, up, down = (torch.empty(*shape, device="meta", dtype=torch.bfloat16)
                          for shape in ((width, hidden), (width, hidden), (hidden, width)))
        with FlopCounterMode(display=False) as counter:
            (F.silu(x @ gate) * (x @ up)) @ down
        return counter.get_total_flops()

    assert uniform_rows(tokens) == {1536}
    # Expert e: 6 n D H FLOPs over its 3 D H b bytes of weights: n FLOPs per byte in bfloat16.
    weight_bytes = torch.empty(3, width, hidden, device="meta", dtype=torch.bfloat16).nbytes
    assert expert_flops(1536) / weight_bytes == 1536
    routed = experts * expert_flops(1536)
    assert round(700 / 4.2) == 167 and round(routed / 1e12, 2) == 1.70 and round(routed / 700e12 * 1e3, 1) == 2.4
    assert uniform_rows(64) == {6}  # rows per expert in decoding, T = 64
    assert round(experts * weight_bytes / 1e9, 1) == 1.1
    permutations, swiglu_traffic = 4 * tokens * k * width * b, 6 * tokens * k * hidden * b
    assert round(permutations / 1e9, 2) == 1.61 and round(swiglu_traffic / 1e9, 2) == 1.66
    assert round((permutations + swiglu_traffic) / 4.2e12 * 1e3, 1) == 0.8
    # Self-check 1: forward and backward, router included.
    total = 3 * (routed + 6 * tokens * shared * width * hidden + 2 * tokens * width * experts)
    assert [round(v / 1e12, 3) for v in (routed, 6 * tokens * shared * width * hidden, 2 * tokens * width * experts)] \
        == [1.701, 0.567, 0.004]
    assert round(total / 1e12, 2) == 6.82


WORKED_X = torch.tensor([[2.0, 3, 0], [0, 2, 3], [3, 0, 2], [1, 2, 0]], dtype=F64)


def test_layer_worked_example():
    k = 2
    routed = topk_route(WORKED_X, torch.eye(3, dtype=F64), k)
    assert routed.expert_index_TK.tolist() == [[1, 0], [2, 1], [0, 2], [1, 0]]
    close(routed.gate_TK, [0.731, 0.269] * 4, 3)
    assert torch.allclose(routed.gate_TK.double(), torch.sigmoid(torch.tensor([1.0, -1.0], dtype=F64)).repeat(4, 1),
                          atol=1e-6)
    flat, order, counts, ends, inverse = dispatch(routed.expert_index_TK, 3)
    assert flat.tolist() == [1, 0, 2, 1, 0, 2, 1, 0]
    assert order.tolist() == [1, 4, 7, 0, 3, 6, 2, 5]
    assert (order // k).tolist() == [0, 2, 3, 0, 1, 3, 1, 2]
    assert counts.tolist() == [3, 3, 2] and ends.tolist() == [3, 6, 8]
    assert inverse.tolist() == [3, 0, 6, 4, 1, 7, 5, 2]
    assert inverse[2:4].tolist() == [6, 4]  # token 1: expert 2's first row, expert 1's second
    # y_1 = sigma(1) f_2(x_1) + sigma(-1) f_1(x_1) + shared(x_1), through the reference layer.
    w = layer_weights(tokens=4, width=3, hidden=2, experts=3, shared=1, shared_hidden=2, seed=5)
    w.update(x=WORKED_X, router=torch.eye(3, dtype=F64))
    y = moe_layer_torch(*(w[name] for name in ORDER), k)
    x1 = WORKED_X[1:2]
    f = [swiglu(x1, w["gate"][e], w["up"][e], w["down"][e]) for e in range(3)]
    s = torch.sigmoid(torch.tensor(1.0, dtype=F64))
    expected = s * f[2] + (1 - s) * f[1] + swiglu(x1, w["shared_gate"][0], w["shared_up"][0], w["shared_down"][0])
    assert torch.allclose(y[1], expected[0], atol=1e-12)
    # Self-check 2: token 3 reads sorted rows 5 and 2; token 2 choosing (0, 1) gives counts (3, 4, 1).
    assert inverse[6:8].tolist() == [5, 2]
    changed = routed.expert_index_TK.clone()
    changed[2] = torch.tensor([0, 1])
    _, _, counts, ends, _ = dispatch(changed, 3)
    assert counts.tolist() == [3, 4, 1] and ends.tolist() == [3, 7, 8]


def test_top1_renormalised_gate_gives_the_router_no_gradient():
    w = layer_weights(tokens=6, width=4, hidden=3, experts=4, shared=0, shared_hidden=2, seed=11)
    router = w["router"].clone().requires_grad_()
    args = [router if name == "router" else w[name] for name in ORDER]
    (grad,) = torch.autograd.grad(moe_layer_torch(*args, 1, normalize_topk=True).sum(), router)
    assert grad.abs().max() < 1e-12
    (grad,) = torch.autograd.grad(moe_layer_torch(*args, 1, normalize_topk=False).sum(), router)
    assert grad.abs().max() > 1e-3


# --- the routers' worked decisions ----------------------------------------------------------------------------------


def test_router_worked_decision():
    logits = torch.tensor([[4.0, 2, 1, 1], [2, 3, 2, 1]]).log()
    out = topk_route(logits, torch.eye(4), 2)
    close(torch.softmax(logits.double(), -1), [[0.5, 0.25, 0.125, 0.125], [0.25, 0.375, 0.25, 0.125]], 6)
    assert out.expert_index_TK.tolist() == [[0, 1], [1, 0]]
    close(out.gate_TK, [2 / 3, 1 / 3, 0.6, 0.4], 6)
    assert out.tokens_per_expert_E.tolist() == [2, 2, 0, 0]
    close(out.tokens_per_expert_E / (2 * 2), [0.5, 0.5, 0, 0], 6)
    close(torch.softmax(logits, -1).mean(0), [0.375, 0.3125, 0.1875, 0.125], 6)
    assert out.balance_loss.item() == pytest.approx(4 * (0.5 * 0.375 + 0.5 * 0.3125)) == 1.375
    close(out.z_loss, 4.324, 3)
    assert out.z_loss.item() == pytest.approx(math.log(8) ** 2, rel=1e-6)


def test_router_self_check():
    # (1) k = 1, T = E, token t scoring expert t highest and the others equally: exactly 1.
    experts = 5
    logits = torch.full((experts, experts), -0.7) + 2.1 * torch.eye(experts)
    assert topk_route(logits, torch.eye(experts), 1).balance_loss.item() == pytest.approx(1.0, abs=1e-6)
    # (2) A zero router with E = 64: (ln 64)^2 = 17.30.
    z = topk_route(torch.randn(3, 8), torch.zeros(64, 8), 2).z_loss.item()
    assert z == pytest.approx(math.log(64) ** 2, rel=1e-6) and round(z, 2) == 17.30
    # (3) Shapes and dtypes for T = 8, E = 4, k = 2, bfloat16 inputs.
    out = topk_route(torch.randn(8, 16).bfloat16(), torch.randn(4, 16).bfloat16(), 2)
    assert [(tuple(t.shape), t.dtype) for t in out] == [((8, 2), torch.int64), ((8, 2), F32), ((4,), torch.int64),
                                                        ((), F32), ((), F32)]


NOISY_CLEAN = torch.tensor([[1.0, 0.8, 0.0]])
NOISY_SAMPLES = torch.tensor([[-0.5, 0.5, 0.2]])


def noisy_inputs():
    """x = (clean logits, 0, 0, 0): gate weights read the first three columns, noise weights the last three."""
    x = torch.cat([NOISY_CLEAN, torch.zeros(1, 3)], 1)
    gate_w = torch.cat([torch.eye(3), torch.zeros(3, 3)], 1)
    noise_w = torch.cat([torch.zeros(3, 3), torch.eye(3)], 1)
    return x, gate_w, noise_w


def test_noisy_topk_worked_decision():
    x, gate_w, noise_w = noisy_inputs()
    close(F.softplus(torch.tensor(0.0)), 0.693, 3)
    train = noisy_topk_route(x, gate_w, noise_w, NOISY_SAMPLES, 2, training=True)
    close(train.noisy_logits_TE, [0.653, 1.147, 0.139], 3)
    assert train.expert_index_TK.tolist() == [[1, 0]]
    close(train.gate_TK, [0.621, 0.379], 3)
    evaluation = noisy_topk_route(x, gate_w, noise_w, NOISY_SAMPLES, 2, training=False)
    close(evaluation.noisy_logits_TE, [1.0, 0.8, 0.0], 6)
    assert evaluation.expert_index_TK.tolist() == [[0, 1]]
    close(evaluation.gate_TK, [0.550, 0.450], 3)


def test_noisy_topk_self_check():
    x, gate_w, noise_w = noisy_inputs()
    # (1) dH_i / d(x . w_noise_i) = eps_i sigma(0): through the noise weights' column i, whose input is 1.
    x = x.clone()
    x[0, 3:] = 1.0
    noise_w = noise_w.clone()
    noise_w[:, 3:] = 0.0
    noise_w.requires_grad_()
    train = noisy_topk_route(x, gate_w, noise_w, NOISY_SAMPLES, 2, training=True)
    rows = [torch.autograd.grad(train.noisy_logits_TE[0, i], noise_w, retain_graph=True)[0][i, 3 + i]
            for i in range(3)]
    close(torch.stack(rows), [-0.25, 0.25, 0.1], 6)
    # (2) The top two entries of a softmax over all three noisy logits sum to less than 1.
    full = torch.softmax(train.noisy_logits_TE.detach().double(), -1)[0, [1, 0]]
    close(full, [0.506, 0.309], 3)
    close(full.sum(), 0.815, 3)


CAPACITY_ROUTING = torch.tensor([(0, 1), (0, 2), (1, 0), (0, 1), (2, 0), (0, 1)])


def token_major_positions(experts_tk, capacity, num_experts):
    """The rejected priority: token 0's slots, then token 1's, ..."""
    filled, dropped = [0] * num_experts, []
    for t, row in enumerate(experts_tk.tolist()):
        for j, e in enumerate(row):
            if filled[e] < capacity:
                filled[e] += 1
            else:
                dropped.append((t, j))
    return dropped


def test_capacity_worked_decision_and_self_check():
    gates = torch.full((6, 2), 0.5)
    out = apply_capacity(CAPACITY_ROUTING, gates, 3, 1.0)
    assert out.capacity == 4
    assert out.position_TK.tolist() == [[0, 1], [1, 1], [0, -1], [2, 2], [0, -1], [3, 3]]
    assert out.tokens_per_expert_E.tolist() == [4, 4, 2]
    # (1) c_f = 1.25: capacity 5, only token 4's second choice dropped.
    out = apply_capacity(CAPACITY_ROUTING, gates, 3, 1.25)
    assert out.capacity == 5 and (~out.kept_TK).nonzero().tolist() == [[4, 1]]
    # (2) Token-major priority at c_f = 1 drops token 4's slot 1 and token 5's slot 0.
    assert token_major_positions(CAPACITY_ROUTING, 4, 3) == [(4, 1), (5, 0)]


# The logits of the expert-choice figure (assignment/handout/figures.typ, fig-routing-choice).
FIGURE_LOGITS = torch.tensor([
    (2.0, 0.3, -0.5, 0.1), (1.6, 1.1, -0.2, 0.0), (0.2, 1.8, 0.4, -0.6), (1.9, -0.3, 0.6, 0.2),
    (0.1, 0.2, 1.4, 0.9), (1.2, 0.9, 0.8, -0.4), (2.2, 0.4, 0.1, 0.7), (-0.2, 0.5, 0.3, 1.0),
])


def test_expert_choice_worked_decision_and_self_check():
    out = expert_choice_route(FIGURE_LOGITS, torch.eye(4), 1.0)
    assert out.token_index_EC.tolist() == [[0, 6], [2, 1], [4, 5], [7, 4]]
    assert out.experts_per_token_T.tolist() == [1, 1, 1, 0, 2, 1, 1, 1]
    probs = torch.softmax(FIGURE_LOGITS.double(), -1)
    close(probs[3, 0], 0.64, 2)
    for e in range(4):  # every expert scores two tokens above token 3
        assert (probs[:, e] > probs[3, e]).sum() >= 2
    # (1) C for T = 8, E = 4 and c_f = 0.25, 1.25, 8.
    x = torch.randn(8, 4)
    assert [expert_choice_route(x, torch.eye(4), c).token_index_EC.shape[1] for c in (0.25, 1.25, 8.0)] == [1, 2, 8]
    # (2) A zero router: every expert takes tokens 0 .. C - 1.
    out = expert_choice_route(x, torch.zeros(4, 4), 1.0)
    assert out.token_index_EC.tolist() == [[0, 1]] * 4
    assert out.experts_per_token_T.tolist() == [4, 4, 0, 0, 0, 0, 0, 0]


SIGMOID_AFFINITIES = torch.tensor([[0.8, 0.5, 0.75, 0.2], [0.5, 0.9, 0.25, 0.5]], dtype=F64)
SIGMOID_BIAS = torch.tensor([-0.2, 0.0, 0.0, 0.5])


def test_sigmoid_router_worked_decision_and_self_check():
    logits = logit(SIGMOID_AFFINITIES)
    assert torch.allclose(logits[0], torch.tensor([4.0, 1.0, 3.0, 0.25], dtype=F64).log())
    close(SIGMOID_AFFINITIES.float() + SIGMOID_BIAS, [[0.6, 0.5, 0.75, 0.7], [0.3, 0.9, 0.25, 1.0]], 6)
    out = sigmoid_route(logits.float(), torch.eye(4), SIGMOID_BIAS, 2, route_scale=2.5)
    assert out.expert_index_TK.tolist() == [[2, 3], [3, 1]]
    close(out.gate_TK, [1.974, 0.526, 0.893, 1.607], 3)
    assert out.tokens_per_expert_E.tolist() == [0, 1, 1, 2]
    # (1) Raising every bias by one constant changes nothing.
    shifted = sigmoid_route(logits.float(), torch.eye(4), SIGMOID_BIAS + 0.25, 2, route_scale=2.5)
    assert torch.equal(shifted.expert_index_TK, out.expert_index_TK)
    assert torch.allclose(shifted.gate_TK, out.gate_TK)
    # (2) rho = 1, no bias: token 0 takes experts 0 and 2.
    plain = sigmoid_route(logits.float(), torch.eye(4), torch.zeros(4), 2)
    assert plain.expert_index_TK[0].tolist() == [0, 2]
    close(plain.gate_TK[0], [0.516, 0.484], 3)


def test_group_limited_worked_decision_and_self_check():
    affinities = torch.tensor([[0.9, 0.1, 0.6, 0.5, 0.8, 0.4]], dtype=F64)
    logits = logit(affinities).float()
    close(affinities.view(3, 2).sum(-1), [1.0, 1.1, 1.2], 6)
    two = group_limited_route(logits, torch.eye(6), num_groups=3, groups_per_token=2, k=2)
    assert two.group_index_TM.tolist() == [[2, 1]] and two.expert_index_TK.tolist() == [[4, 2]]
    close(two.gate_TK, [0.571, 0.429], 3)
    one = group_limited_route(logits, torch.eye(6), num_groups=3, groups_per_token=1, k=2)
    assert one.expert_index_TK.tolist() == [[4, 5]]
    close(one.gate_TK, [0.667, 0.333], 3)
    unlimited = sigmoid_route(logits, torch.eye(6), torch.zeros(6), 2)
    assert unlimited.expert_index_TK.tolist() == [[0, 4]]  # expert 0 is the token's best
    # (1) DeepSeek-V3: 4 of 8 groups of 256 / 8 experts; the chosen experts lie in the chosen groups.
    gen = torch.Generator().manual_seed(3)
    v3 = group_limited_route(torch.randn(5, 16, generator=gen), torch.randn(256, 16, generator=gen), num_groups=8,
                             groups_per_token=4, k=8)
    candidates = ((torch.arange(256) // 32)[None, :, None] == v3.group_index_TM[:, None, :]).any(-1)
    assert candidates.sum(-1).tolist() == [128] * 5
    assert candidates.gather(1, v3.expert_index_TK).all()
    # (2) M = G is plain top-k over all sigmoid affinities, renormalised.
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(20, 8, generator=gen), torch.randn(12, 8, generator=gen)
    full = group_limited_route(x, w, num_groups=4, groups_per_token=4, k=3)
    plain = sigmoid_route(x, w, torch.zeros(12), 3)
    assert torch.equal(full.expert_index_TK, plain.expert_index_TK)
    assert torch.allclose(full.gate_TK, plain.gate_TK)


def test_bias_balancing_worked_step_and_self_check():
    scores = torch.tensor([[0.9, 0.5, 0.3, 0.4], [0.8, 0.7, 0.2, 0.5]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.15])
    close(scores + bias, [[0.9, 0.5, 0.3, 0.55], [0.8, 0.7, 0.2, 0.65]], 6)
    out = update_expert_bias(scores, bias, 2, 0.001)
    assert out.tokens_per_expert_E.tolist() == [2, 1, 0, 1]
    close(out.expert_bias_E, [-0.001, 0.0, 0.001, 0.15], 6)
    # (1) T = 4096, E = 64, k = 8: a load of exactly 512 keeps the bias.
    tokens, experts, k = 4096, 64, 8
    chosen = (torch.arange(tokens)[:, None] * k + torch.arange(k)) % experts  # every expert chosen 512 times
    balanced = torch.zeros(tokens, experts).scatter(1, chosen, 1.0)
    bias = torch.linspace(-0.01, 0.01, experts)
    out = update_expert_bias(balanced, bias, k, 0.001)
    assert out.tokens_per_expert_E.tolist() == [512] * experts and torch.equal(out.expert_bias_E, bias)
    # (2) A gap of 0.05 closing by 2 gamma a step: 25 steps, run on the reference, until the other expert is chosen.
    scores, bias, steps = torch.tensor([[0.55, 0.5]] * 4, dtype=F64), torch.zeros(2, dtype=F64), 0
    while (scores + bias)[0, 0] - (scores + bias)[0, 1] > 1e-9:
        bias = update_expert_bias(scores, bias, 1, 0.001).expert_bias_E
        steps += 1
    assert steps == 25


def test_sequence_balance_loss_self_check():
    alpha = 0.01
    # (1) One sequence routed entirely to expert 0 with equal logits: alpha, and a gradient along (3, -1, -1, -1).
    logits = torch.zeros(1, 6, 4, dtype=F64, requires_grad=True)
    index = torch.zeros(1, 6, 1, dtype=torch.int64)
    loss = sequence_balance_loss(logits, index, alpha)
    assert loss.item() == pytest.approx(alpha)
    (grad,) = torch.autograd.grad(loss, logits)
    direction = grad[0, 0] / grad[0, 0, 1].abs()
    assert torch.allclose(direction.double(), torch.tensor([3.0, -1, -1, -1], dtype=F64), atol=1e-5)
    # (2) Sequence-wise 1.5 alpha; pooled into one sequence, alpha.
    third = math.log(3.0)
    per_token = torch.tensor([[third, -third], [-third, third]])  # normalised affinities (0.75, 0.25) and back
    logits = per_token[:, None, :].expand(2, 5, 2).contiguous()
    index = torch.tensor([0, 1])[:, None, None].expand(2, 5, 1).contiguous()
    assert sequence_balance_loss(logits, index, alpha).item() == pytest.approx(1.5 * alpha, rel=1e-6)
    pooled = sequence_balance_loss(logits.reshape(1, 10, 2), index.reshape(1, 10, 1), alpha)
    assert pooled.item() == pytest.approx(alpha, rel=1e-6)


def test_upcycle_self_check():
    width, hidden, experts = 4096, 14336, 8
    experts_bytes = torch.empty(experts, 3, width, hidden, device="meta", dtype=torch.bfloat16).nbytes
    router_bytes = torch.empty(experts, width, device="meta", dtype=torch.float32).nbytes
    assert (experts_bytes, router_bytes) == (2818572288, 131072) and round(experts_bytes / 1e9, 2) == 2.82
    # (2) router_std = 0: experts 0 and 1 for every token, gates 1/2, and the dense MLP's output.
    gen = torch.Generator().manual_seed(2)
    gate, up, down = (torch.randn(*shape, generator=gen, dtype=F64) for shape in ((5, 6), (5, 6), (6, 5)))
    moe = upcycle(gate, up, down, num_experts=4, router_std=0.0, seed=0)
    x = torch.randn(7, 6, generator=gen, dtype=F64)
    routed = topk_route(x, moe.router_weight_ED, 2)
    assert routed.expert_index_TK.tolist() == [[0, 1]] * 7 and torch.all(routed.gate_TK == 0.5)
    empty = x.new_zeros(0, 1, 6)
    y = moe_layer_torch(x, moe.router_weight_ED.double(), moe.gate_proj_EHD, moe.up_proj_EHD, moe.down_proj_EDH,
                        empty.view(0, 1, 6), empty.view(0, 1, 6), empty.view(0, 6, 1), 2)
    assert torch.allclose(y, swiglu(x, gate, up, down), atol=1e-12)


MIXTRAL = dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
               num_routed_experts=8, experts_per_token=2, expert_intermediate_size=14336)


def test_accounting_self_check():
    counts = parameter_counts(**MIXTRAL)
    assert (counts.total, counts.activated) == (46702792704, 12879925248)
    ninth = parameter_counts(**{**MIXTRAL, "num_routed_experts": 9})
    one_expert = (ninth.routed_experts - counts.routed_experts) // 32  # one more expert in each of 32 layers
    assert one_expert == 176160768 and counts.routed_experts == 45097156608 == one_expert * 8 * 32
    assert round(counts.routed_experts / counts.total * 100) == 97
    tied = parameter_counts(**MIXTRAL, tied_embeddings=True)
    assert counts.total - tied.total == counts.activated - tied.activated == 131072000


def test_analysis_warm_ups():
    # (1) 1024 tokens, top-1 of 16, c_f = 1.5: 96 slots, 928 dropped when every token chooses expert 0.
    out = apply_capacity(torch.zeros(1024, 1, dtype=torch.int64), torch.ones(1024, 1), 16, 1.5)
    assert out.capacity == 96 and int((~out.kept_TK).sum()) == 928
    # (2) E = 4, top-1, expert 0 with probability 0.7: 2.8.
    loss = topk_route(torch.tensor([[7.0, 1, 1, 1]] * 5).log(), torch.eye(4), 1).balance_loss
    assert loss.item() == pytest.approx(2.8, rel=1e-6)
    # (3) The toy model: 186688 / 260416.
    toy = parameter_counts(vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16,
                           num_routed_experts=8, experts_per_token=2, expert_intermediate_size=32)
    assert (toy.activated, toy.total) == (186688, 260416) and round(toy.activated / toy.total, 3) == 0.717


SECTIONS = Path(__file__).resolve().parents[1] / "assignment/handout/sections/moe"


@pytest.mark.parametrize("section, printed", [
    ("moe_layer", ("that is 1536", "1.70 TFLOP in the forward", "(2.4 ms at that rate)", "approx 170$",
                   "about 0.8 ms at 4.2 TB/s", "$n_e = 6$", "1.1 GB of expert weights")),
    ("group_limited_routing", ("(1) Among $4 dot 32 = 128$",)),
    ("bias_balancing", ("$overline(n) = 4096 dot 8 \\/ 64 = 512$", "(2) 25: the gap closes by $2 gamma = 0.002$")),
    ("upcycle", ("$8 dot 3 dot 4096 dot 14336 dot 2 = 2818572288$ bytes (2.82 GB); the float32 router 131072 bytes",)),
    ("accounting", ("$3 dot 4096 dot 14336 = 176160768$; times $8 dot 32$: $45097156608$, 97 % of the total",)),
])
def test_the_sections_print_the_numbers_recomputed_here(section, printed):
    """Each number above, recomputed by a test of this file, is the one its section prints."""
    text = " ".join((SECTIONS / f"{section}.typ").read_text().split())
    for string in printed:
        assert string in text, string
