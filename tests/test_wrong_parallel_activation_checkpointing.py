"""The grader fails each deliberately wrong parallel.activation_checkpointing for its fault.

Each variant in tests/wrong/parallel_activation_checkpointing/ is a plausible student checkpoint with one bug. Each run
selects only the test that bug must fail.
"""

from __future__ import annotations

import pytest

from tests.grading import assert_fails_for, run_grader, wrong_impl

PROBLEM = "parallel.activation_checkpointing"


def case(variant: str, test: str, *fragments: str):
    """The grader's `test` must fail for the wrong implementation `variant`, with output containing every fragment."""
    return pytest.param(variant, test, fragments, id=variant)


CASES = [
    case("keeps_activations", "saves_no_activations", "bytes allocated during it are still held",
         "recompute the activations in backward"),
    case("no_rng_replay", "dropout_replays", "gradient of", "out of tolerance", "dropout="),
    case("rng_not_restored", "dropout_replays", "the next random numbers differ",
         "leave the generator as it found it"),
    case("detaches_inputs", "matches_plain_block", "gradient of input 0 is None"),
    case("parameters_not_in_graph", "inputs_without_grad", "does not require grad"),
    case("uses_torch_checkpoint", "matches_plain_block", "ForbiddenModuleUsed",
         "torch.utils.checkpoint.checkpoint may not be used"),
]


@pytest.mark.parametrize("variant, test, fragments", CASES)
def test_grader_fails_wrong_checkpointing(variant, test, fragments):
    run = run_grader(wrong_impl(PROBLEM, variant), "-k", f"parallel_activation_checkpointing and test_{test}")
    assert_fails_for(run, PROBLEM, test, *fragments)
