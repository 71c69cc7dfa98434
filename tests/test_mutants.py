"""The mutants of tests/wrong/ are well formed, without grading any: each folder holds its two files, each diff
applies and changes the reference, each declared test exists, and the rounds of tests/test_wrong.py keep problems
apart."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests import mutants
from tests.grading import ROOT

MUTANTS = mutants.discover()


def test_every_variant_folder_holds_a_diff_and_a_declaration():
    for folder in mutants.variant_folders():
        files = sorted(path.name for path in folder.iterdir())
        assert files == [mutants.DIFF, mutants.EXPECT], f"{folder.relative_to(ROOT)} holds {files}"


def test_every_diff_applies_and_changes_the_reference_and_its_base():
    by_id = {mutant.id: mutant for mutant in MUTANTS}
    for mutant in MUTANTS:
        source = mutant.source()
        assert source != (mutants.REFERENCE / mutant.module_path).read_text(), f"{mutant.id} changes nothing"
        if mutant.based_on:
            base = by_id[f"{mutant.problem}/{mutant.based_on}"]
            assert source != base.source(), f"{mutant.id} is its base {base.id} again"


def test_no_mutant_imports_from_its_package():
    """A round's package holds other problems' mutants: a relative import would run one of them in this problem's
    grading (and in a package of its own, find nothing)."""
    for mutant in MUTANTS:
        relative = [node.lineno for node in ast.walk(ast.parse(mutant.source()))
                    if isinstance(node, ast.ImportFrom) and node.level > 0]
        assert not relative, f"{mutant.id} imports from its own package at lines {relative}"


def test_every_declared_test_is_in_its_problems_grader_module():
    modules = sorted({mutant.node_id.partition("::")[0] for mutant in MUTANTS})
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", *modules, "--collect-only", "-q", "-p", "no:cacheprovider",
         "--impl", "reference", "--profile", "ci"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    node_ids = {line for line in collected.stdout.splitlines() if "::" in line}
    assert node_ids, collected.stdout[-3000:] + collected.stderr[-3000:]
    missing = [f"{mutant.id}: {mutant.node_id}" for mutant in MUTANTS if mutant.node_id not in node_ids]
    assert not missing, "declared tests the grader does not have:\n" + "\n".join(missing)


def test_a_round_holds_one_mutant_per_problem_and_one_set_of_grader_arguments():
    rounds = mutants.rounds(MUTANTS)
    assert sorted(mutant.id for members in rounds for mutant in members) == sorted(mutant.id for mutant in MUTANTS)
    for members in rounds:
        ids = [mutant.id for mutant in members]
        assert len({mutant.problem for mutant in members}) == len(members), ids
        assert len({mutant.grader_args for mutant in members}) == 1, ids


def test_a_diff_applies_to_a_reference_grown_above_its_hunks():
    mutant = MUTANTS[0]
    diff = (mutant.folder / mutants.DIFF).read_text()
    added = "# a new first line\n# and a second\n"
    grown = added + (mutants.REFERENCE / mutant.module_path).read_text()
    assert mutants.apply_diff(grown, diff, mutant.id) == added + mutant.source()


def test_a_hunk_that_does_not_apply_names_its_mutant():
    mutant = MUTANTS[0]
    diff = (mutant.folder / mutants.DIFF).read_text()
    removed = next(line[1:] for line in diff.splitlines(keepends=True)[2:] if line.startswith("-"))
    changed = (mutants.REFERENCE / mutant.module_path).read_text().replace(removed, "# changed since\n")
    with pytest.raises(ValueError, match=f"{mutant.id}: hunk @@ .* does not apply"):
        mutants.apply_diff(changed, diff, mutant.id)


def test_an_edit_of_the_reference_beside_a_change_leaves_the_mutant_valid():
    """The line just before and just after each hunk's first change edited in the reference (context, not the
    change): the mutant still applies, to the edited reference with its one change."""
    checked = 0
    for mutant in (m for m in MUTANTS if not m.based_on):
        reference = (mutants.REFERENCE / mutant.module_path).read_text().splitlines(keepends=True)
        source = mutant.source().splitlines(keepends=True)
        first = next(i for i, (a, b) in enumerate(zip(reference, source)) if a != b)
        last_ref, last_src = len(reference) - 1, len(source) - 1
        while reference[last_ref] == source[last_src]:
            last_ref, last_src = last_ref - 1, last_src - 1
        if first == 0 or last_ref + 1 >= len(reference) or last_ref - first > 6 or last_ref < first:
            continue  # a change at the file's edge, one spread over several hunks, or an insertion (whose only
            # anchors are the lines around it)
        edited = [*reference[:first - 1], "# edited beside\n", *reference[first:last_ref + 1], "# edited beside\n",
                  *reference[last_ref + 2:]]
        want = [*source[:first - 1], "# edited beside\n", *source[first:last_src + 1], "# edited beside\n",
                *source[last_src + 2:]]
        diff = (mutant.folder / mutants.DIFF).read_text()
        assert mutants.apply_diff("".join(edited), diff, mutant.id) == "".join(want), mutant.id
        checked += 1
    assert checked >= 20  # those with one change in one place, away from the docstring


def test_refresh_rewrites_diffs_that_give_the_same_modules():
    for mutant in MUTANTS:
        base = mutants.load(mutant.folder.parent / mutant.based_on).source() if mutant.based_on else \
            (mutants.REFERENCE / mutant.module_path).read_text()
        assert mutants.apply_diff(base, mutants.refreshed_diff(mutant), mutant.id) == mutant.source(), mutant.id
