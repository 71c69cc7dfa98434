"""The annotated SiLU kernel of the GeLU section (assignment/handout/examples/silu.py): it runs and is right, the
section shows the file itself, and the section's self-check answers are the numbers computed here.

Triton's interpreter is chosen by tests/conftest.py before triton is first imported, so on a machine without a GPU
the kernel runs on CPU tensors."""

import importlib.util
import math

import pytest
import torch

from assignment.registry import ROOT

HANDOUT = ROOT / "assignment" / "handout"
EXAMPLE = HANDOUT / "examples" / "silu.py"
SECTION = HANDOUT / "sections" / "kernels" / "gelu.typ"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def grouped(number: int) -> str:
    """A number as the section prints it: groups of three digits joined by typst's non-breaking space."""
    return f"{number:,}".replace(",", "~")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("handout_example_silu", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [1, 1000, 4097])
def test_silu_matches_torch(example, n, dtype):
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 4).to(dtype).to(DEVICE)
    y = example.silu(x)
    assert y.dtype == dtype and y.shape == x.shape
    expected = torch.nn.functional.silu(x.double()).to(dtype)
    torch.testing.assert_close(y, expected)


def test_silu_refuses_what_it_does_not_handle(example):
    with pytest.raises(TypeError):
        example.silu(torch.zeros(4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError):
        example.silu(torch.zeros(4, 4, device=DEVICE).t())


def test_the_section_shows_the_tested_file():
    assert 'read("/examples/silu.py")' in SECTION.read_text()


def test_the_self_check_answers_are_right():
    section = SECTION.read_text()
    n, block = 8192 * 8192, 1024
    assert grouped(2 * n * 2) in section  # bfloat16: read n * 2 bytes, write n * 2 bytes
    assert grouped(math.ceil(n / block)) in section  # programs
    programs = math.ceil(4097 / block)
    assert f"{programs} programs" in section and f"{programs * block - 4097} lanes" in section
