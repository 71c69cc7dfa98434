"""References checked against their pinned conventions written out independently, element by element."""

from __future__ import annotations

import pytest
import torch

from grader.attention.dsa_cases import TopkCase, topk_by_rule
from grader.session.packages import PackageSpec, load_problem_module
from tests.grading import ROOT

TOPK_CASES = [TopkCase(1, 1, 1), TopkCase(1, 9, 12), TopkCase(1, 20, 5, values="equal"), TopkCase(2, 23, 6, seed=11),
              TopkCase(1, 30, 17, values="normal", seed=2)]


@pytest.mark.parametrize("case", TOPK_CASES, ids=lambda c: f"seq={c.seq}-topk={c.topk}-{c.values}")
def test_sparse_dsa_selection_is_the_pinned_rule(case):
    """select_topk: the topk highest scores among s <= t, equal scores to the lower key, ascending, -1 padded."""
    reference = load_problem_module(PackageSpec("reference", ROOT / "reference"), "attention.sparse_dsa")
    scores = case.scores(torch.device("cpu"))
    assert torch.equal(reference.select_topk(scores, case.topk), topk_by_rule(scores, case.topk))
