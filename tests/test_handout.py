"""The handout: handout.pdf matches its sources, every problem has a section, and the freshness check notices edits."""

import ast
import shutil
import textwrap

import pytest

from assignment.handout import build
from assignment.registry import PROBLEMS, ROOT

REBUILD = "run python -m assignment.handout.build"


def test_handout_pdf_matches_its_sources():
    pdf = ROOT / build.OUTPUT
    assert pdf.is_file(), f"handout.pdf is missing: {REBUILD}"
    assert build.embedded_sha256(pdf.read_bytes()) == build.current_source_sha256(ROOT), (
        f"handout.pdf is older than its source: {REBUILD}"
    )


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda problem: problem.id)
def test_every_problem_has_a_section(problem):
    assert problem.handout_section.is_file(), f"{problem.id} has no handout section at {problem.handout_section}"


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda problem: problem.id)
def test_every_section_asks_a_self_check(problem):
    """Each section ends its teaching with ungraded questions (self_check.typ), answered at the chapter's end."""
    section = problem.handout_section.read_text()
    assert '#import "/self_check.typ": self-check' in section and "#self-check(" in section, (
        f"{problem.handout_section} has no self-check: add #self-check([questions], [answers])")


@pytest.fixture
def repo_copy(tmp_path):
    """The files the handout is built from, copied under tmp_path."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "assignment", tmp_path / "assignment", ignore=ignore)
    shutil.copytree(ROOT / build.STUBS_DIR, tmp_path / build.STUBS_DIR, ignore=ignore)
    for graders_part in (build.SHEET_SYNTAX, build.SOURCE_POLICY):
        (tmp_path / graders_part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / graders_part, tmp_path / graders_part)
    return tmp_path


def test_editing_a_section_makes_check_fail(repo_copy, capsys):
    pytest.importorskip("typst")
    assert build.main(["--root", str(repo_copy)]) == 0
    assert build.main(["--check", "--root", str(repo_copy)]) == 0
    section = repo_copy / build.HANDOUT_DIR / build.section_path(PROBLEMS[0])
    section.write_text(section.read_text() + "\nOne more sentence.\n")
    pdf_before = (repo_copy / build.OUTPUT).read_bytes()
    capsys.readouterr()

    assert build.main(["--check", "--root", str(repo_copy)]) == 1
    assert "handout.pdf is older than its source" in capsys.readouterr().err
    assert (repo_copy / build.OUTPUT).read_bytes() == pdf_before, "--check must write nothing"


def test_a_missing_section_is_a_build_error_naming_it(repo_copy, capsys):
    section = build.HANDOUT_DIR / build.section_path(PROBLEMS[-1])
    (repo_copy / section).unlink()
    assert build.main(["--root", str(repo_copy)]) == 1
    assert section.as_posix() in capsys.readouterr().err
    assert not (repo_copy / build.OUTPUT).exists()


def test_contract_is_read_from_the_stub_without_importing_it(tmp_path):
    stub = tmp_path / "stub.py"
    stub.write_text(textwrap.dedent('''
        """Module summary."""
        import this_module_does_not_exist

        class Result(NamedTuple):
            values_N: Tensor  # float32 [N]
            count: int = 0

        class Worker:
            """Does work."""
            def __init__(self, size: int) -> None:
                """Make one."""
            def run(self, *jobs, timeout_s: float = 1.0, **options) -> Result:
                """Run the jobs."""
            def _helper(self): ...

        def compute(x: Tensor, /, k: int, *, exact: bool = True) -> Result:
            """Compute it."""

        def _private(): ...
    '''))
    contract = build.stub_contract(stub)
    assert contract["module_doc"] == "Module summary."
    result, worker, compute = contract["items"]
    assert result["signature"] == "class Result(NamedTuple):\n    values_N: Tensor  # float32 [N]\n    count: int = 0"
    assert [method["name"] for method in worker["methods"]] == ["Worker.__init__", "Worker.run"]
    assert worker["methods"][1]["signature"] == (
        "def run(self, *jobs, timeout_s: float = 1.0, **options) -> Result:"
    )
    assert compute["signature"] == "def compute(x: Tensor, /, k: int, *, exact: bool = True) -> Result:"
    assert compute["doc"] == "Compute it."


def test_a_contract_line_wider_than_the_page_is_a_build_error_naming_its_line(tmp_path):
    stub = tmp_path / "stub.py"
    fits = "x" * build.CONTRACT_WIDTH
    stub.write_text(f'def compute(x):\n    """Compute it.\n\n    {fits}\n    {fits}y\n    """\n')
    with pytest.raises(build.BuildError) as error:
        build.stub_contract(stub)
    assert f"{stub}:5: {build.CONTRACT_WIDTH + 1} characters" in str(error.value)
    assert f"{stub}:4:" not in str(error.value)


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda problem: problem.id)
def test_every_contract_line_fits_the_page(problem):
    stub = ROOT / build.stub_path(problem)
    source = stub.read_text()
    overlong = build.overlong_lines(ast.parse(source), build.trailing_comments(source), source)
    assert not overlong, f"{stub}: lines (number, characters) wider than {build.CONTRACT_WIDTH}: {overlong}"


def test_the_deliverables_are_the_functions_and_methods_the_stub_does_not_give(tmp_path):
    stub = tmp_path / "stub.py"
    stub.write_text(textwrap.dedent('''
        class Config(NamedTuple):
            size: int

        class Layer:
            """A layer."""
            def __init__(self, config: Config) -> None:
                """Given: the parameters."""
            def forward(self, x):
                """Run it."""

        def helper(x):
            """Given: a conversion."""

        def compute(x):
            """Compute it."""
    '''))
    assert build.deliverables(build.stub_contract(stub)) == ["Layer.forward", "compute"]
