"""Grading parallel.activation_checkpointing: a block run so that backward recomputes its activations.

The program `run_block` builds a block and its inputs from a case, runs forward (checkpointed by the given module, or
plain), measures the bytes still held when forward returns (grader.ranks.memory: every storage allocated during
the call and alive afterwards, wherever it is referenced), runs backward and draws the next random numbers. It runs
in the worker with the student's module, and here with the reference's and with none (the plain block, the expected
values: a correct recomputation replays the same operations on the same values, so it matches to rounding).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from hypothesis import given
from hypothesis import strategies as st

from assignment.registry import BY_ID
from grader.checks.compare import assert_close
from grader.checks.outcomes import WrongAnswer
from grader.checks.profiles import examples
from grader.checks.strategies import data_seeds
from grader.ranks.memory import MemoryProbe

PROBLEM = BY_ID["parallel.activation_checkpointing"]
# The checkpointed forward may keep, beyond its outputs, at most this fraction of what the plain block keeps.
HELD_FRACTION = PROBLEM.held_fraction


class ResidualMLP(torch.nn.Module):
    """x + fc2(dropout(gelu(fc1(layer_norm(x))))): a transformer's MLP sublayer."""

    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, x):
        return x + self.fc2(self.dropout(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


class GatedPair(torch.nn.Module):
    """Two inputs, two outputs: (MLP(x) * sigmoid(gate), mean square of x over features)."""

    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.mlp = ResidualMLP(width, dropout)

    def forward(self, x, gate):
        y = self.mlp(x) * torch.sigmoid(gate)
        return y, x.square().mean(-1)


@dataclass(frozen=True)
class Case:
    kind: str  # "stack": two ResidualMLPs in a Sequential; "pair": GatedPair
    tokens: int
    width: int
    dropout: float
    input_requires_grad: bool
    frozen: bool  # the first fc1's bias (and LayerNorm's weight) have requires_grad=False
    second_output_used: bool  # for "pair": whether the loss uses the second output
    seed: int

    def describe(self) -> str:
        return f"Case({', '.join(f'{k}={v!r}' for k, v in asdict(self).items())})"


def make_block(case: Case) -> torch.nn.Module:
    torch.manual_seed(case.seed)
    if case.kind == "pair":
        block = GatedPair(case.width, case.dropout)
        first = block.mlp
    else:
        block = torch.nn.Sequential(ResidualMLP(case.width, case.dropout), ResidualMLP(case.width, case.dropout))
        first = block[0]
    if case.frozen:
        first.fc1.bias.requires_grad_(False)
        first.norm.weight.requires_grad_(False)
    return block


def make_inputs(case: Case) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The block's inputs and the upstream gradient of each output (None: the output is unused by the loss)."""
    generator = torch.Generator().manual_seed(case.seed + 1)
    x = torch.randn(case.tokens, case.width, generator=generator)
    upstream_y = torch.randn(case.tokens, case.width, generator=generator)
    if case.kind == "stack":
        return [x.requires_grad_(case.input_requires_grad)], [upstream_y]
    gate = torch.randn(case.tokens, case.width, generator=generator).requires_grad_(case.input_requires_grad)
    upstream_norm = torch.randn(case.tokens, generator=generator) if case.second_output_used else None
    return [x.requires_grad_(case.input_requires_grad), gate], [upstream_y, upstream_norm]


def run_block(module, case_fields: dict) -> dict:
    """Forward (checkpointed by `module.checkpoint`, or plain if module is None), held bytes, backward, next draws."""
    case = Case(**case_fields)
    with MemoryProbe(torch.device("cpu")) as memory:
        block = make_block(case)
        inputs, upstream = make_inputs(case)
        memory.start()
        torch.manual_seed(case.seed + 2)  # the dropout masks' stream
        returned = module.checkpoint(block, *inputs) if module is not None else block(*inputs)
        held = memory.probe("after forward")
    # Later layers draw random numbers before backward reaches the block: the recomputation must not rewind them.
    torch.rand(8)
    outputs = [returned] if isinstance(returned, torch.Tensor) else list(returned)
    pairs = [(o, g) for o, g in zip(outputs, upstream) if g is not None and isinstance(o, torch.Tensor)]
    differentiable = [(o, g) for o, g in pairs if o.requires_grad]
    if differentiable:
        torch.autograd.backward([o for o, _ in differentiable], [g for _, g in differentiable])
    return {
        "returned_tensor": isinstance(returned, torch.Tensor),
        "outputs": [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs],
        "requires_grad": [isinstance(o, torch.Tensor) and o.requires_grad for o in outputs],
        "output_bytes": sum(o.untyped_storage().nbytes() for o in outputs if isinstance(o, torch.Tensor)),
        "held_bytes": held,
        "input_grads": [None if x.grad is None else x.grad.detach() for x in inputs],
        "param_grads": {n: None if p.grad is None else p.grad.detach() for n, p in block.named_parameters()},
        "next_random": torch.rand(8),
    }


def cases(dropout: st.SearchStrategy[float], input_requires_grad: st.SearchStrategy[bool]) -> st.SearchStrategy:
    return st.builds(
        Case,
        kind=st.sampled_from(["stack", "pair"]),
        tokens=st.integers(32, 64),
        width=st.integers(12, 24),
        dropout=dropout,
        input_requires_grad=input_requires_grad,
        frozen=st.booleans(),
        second_output_used=st.booleans(),
        seed=data_seeds(),
    )


def run_student(student, case: Case) -> dict:
    with student.describing(case.describe()):
        return student.run_program(f"{__name__}:run_block", asdict(case))


def compare(actual, expected, reference_run, what: str, context: str) -> None:
    if expected is None:
        if actual is not None:
            raise WrongAnswer(f"{what} is set, but the plain block gives it none ({context})")
        return
    if actual is None:
        raise WrongAnswer(f"{what} is None: no gradient reached it through the checkpointed block ({context})")
    assert_close(actual, expected, reference_run, what=what, context=context,
                 multiple=PROBLEM.error_multiple, floor_ulps=PROBLEM.floor_ulps)


def check_against_plain(student, reference, case: Case) -> dict:
    got = run_student(student, case)
    want = run_block(None, asdict(case))
    ref = reference.computed(run_block, asdict(case))  # one recorded unit: the block's parameters get gradients
    context = case.describe()
    if got["returned_tensor"] != want["returned_tensor"] or len(got["outputs"]) != len(want["outputs"]):
        raise WrongAnswer(f"checkpoint returned {len(got['outputs'])} output(s) (a tensor: {got['returned_tensor']}); "
                          f"the block returns {len(want['outputs'])} (a tensor: {want['returned_tensor']}) ({context})")
    for index, (a, e, r) in enumerate(zip(got["outputs"], want["outputs"], ref["outputs"])):
        compare(a, e, r, f"output {index}", context)
    for index, (a, e) in enumerate(zip(got["requires_grad"], want["requires_grad"])):
        # More is allowed: every floating output requires grad once any input or parameter does.
        if e and not a:
            raise WrongAnswer(f"output {index} does not require grad, the plain block's does: outputs must lead "
                              f"back to the inputs and to the block's parameters ({context})")
    for index, (a, e, r) in enumerate(zip(got["input_grads"], want["input_grads"], ref["input_grads"])):
        compare(a, e, r, f"gradient of input {index}", context)
    for name, expected in want["param_grads"].items():
        compare(got["param_grads"][name], expected, ref["param_grads"][name], f"gradient of parameter {name}", context)
    return got


@examples(PROBLEM)
@given(case=cases(dropout=st.just(0.0), input_requires_grad=st.just(True)))
def test_matches_plain_block(student, reference, case):
    check_against_plain(student, reference, case)


@examples(PROBLEM)
@given(case=cases(dropout=st.just(0.0), input_requires_grad=st.just(False)))
def test_inputs_without_grad(student, reference, case):
    """The first block of a network gets data: its parameters must still get gradients."""
    check_against_plain(student, reference, case)


@examples(PROBLEM)
@given(case=cases(dropout=st.sampled_from([0.1, 0.3, 0.5]), input_requires_grad=st.booleans()))
def test_dropout_replays(student, reference, case):
    got = check_against_plain(student, reference, case)
    want = run_block(None, asdict(case))
    if not torch.equal(got["next_random"], want["next_random"]):
        raise WrongAnswer("after backward, the next random numbers differ from those drawn without checkpointing: "
                          f"the recomputation must leave the generator as it found it ({case.describe()})")


@examples(PROBLEM)
@given(case=cases(dropout=st.sampled_from([0.0, 0.2]), input_requires_grad=st.booleans()))
def test_saves_no_activations(student, case):
    got = run_student(student, case)
    plain = run_block(None, asdict(case))
    extra = got["held_bytes"] - got["output_bytes"]
    allowed = HELD_FRACTION * plain["held_bytes"]
    if extra > allowed:
        raise WrongAnswer(
            f"after the checkpointed forward, {got['held_bytes']} bytes allocated during it are still held, "
            f"{extra} beyond its outputs; allowed {allowed:.0f} ({HELD_FRACTION:g} of the {plain['held_bytes']} bytes "
            f"the plain block holds for its backward): keep only the inputs and the generator states, and recompute "
            f"the activations in backward ({case.describe()})"
        )
