"""The grader fails each deliberately wrong moe.router for its fault, and passes the reference on every test.

Each variant in tests/wrong/moe_router/ is a plausible student router with one bug. Each run selects only the test
that bug must fail.
"""

from __future__ import annotations

import pytest

from tests.grading import ROOT, assert_fails_for, run_grader, wrong_impl

PROBLEM = "moe.router"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("no_renormalisation", "indices_and_gates", "gate_TK", "out of tolerance", "normalize_topk=True"),
    case("z_loss_unsquared", "losses", "z_loss", "out of tolerance"),
    case("balance_from_chosen_probs", "losses", "balance_loss", "out of tolerance"),
    case("balance_without_num_experts", "losses", "balance_loss", "out of tolerance"),
    case("ties_to_highest_index", "tie_breaking", "expert_index_TK", "values differ"),
    case("counts_first_choice_only", "tokens_per_expert", "tokens_per_expert_E", "values differ"),
    # Computing in bfloat16 or float16 shows first in the floating outputs; the inputs' dtype is in the description.
    case("logits_in_input_dtype", "low_precision_inputs", "out of tolerance", "float16"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_router(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"moe_router and test_{test}")
    assert_fails_for(run, PROBLEM, test, *fragments)


def test_reference_passes_every_router_test():
    run = run_grader(ROOT / "reference", "-k", "moe_router")
    tests = run.tests_of(PROBLEM)
    assert tests, f"no moe.router test ran:\n{run.output[-3000:]}"
    not_passed = [f"{t['name']}: {t['output']}" for t in tests if t.get("status") != "passed"]
    assert not not_passed, "the reference failed:\n" + "\n".join(not_passed)
    assert run.returncode == 0, run.output[-3000:]
