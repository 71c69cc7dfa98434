"""The annotated SiLU kernel of the GeLU section (assignment/handout/examples/silu.py): it runs and is right, the
section shows the file itself, and the section's self-check answers are the numbers computed here.

Triton's interpreter is chosen by tests/conftest.py before triton is first imported, so on a machine without a GPU
the kernel runs on CPU tensors."""

import importlib.util
import json
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


PROFILE = HANDOUT / "data" / "silu_profile.json"
FIGURE = HANDOUT / "figures_silu_profile.typ"


@pytest.fixture(scope="module")
def profile():
    return json.loads(PROFILE.read_text())


def gaps_and_spans(trace, kind):
    """The GPU's idle time before each kernel of `kind` after the first, and each such kernel's duration (µs)."""
    kernels = [k for k in trace["kernels"] if k["kind"] == kind]
    gaps = [b["start_us"] - a["end_us"] for a, b in zip(kernels, kernels[1:])]
    return gaps, [k["end_us"] - k["start_us"] for k in kernels]


def test_the_trace_was_recorded_on_a_gpu_with_every_call(profile):
    """What benchmarks/silu_profile.py writes, from a GPU: five silu kernels and five copies in each trace, in the
    order issued, and silu's five launches from the host."""
    assert profile["gpu"].startswith("NVIDIA") and profile["torch"] and profile["triton"]
    assert set(profile["traces"]) == {"small", "large"}
    for trace in profile["traces"].values():
        kinds = [k["kind"] for k in trace["kernels"]]
        assert kinds == ["silu"] * profile["calls"] + ["copy"] * profile["calls"], kinds
        assert len(trace["launches"]) == profile["calls"]  # silu's launches; the copies are memcpys
        assert all(k["end_us"] > k["start_us"] >= 0 for k in trace["kernels"] + trace["launches"])
        assert trace["bytes_moved_per_call"] == 2 * trace["n"] * 2  # bfloat16: read and write n elements


def test_the_panel_titles_say_what_the_trace_shows(profile):
    """The figure's titles are claims about the recorded trace: at the small size the GPU waits between kernels
    longer than each kernel runs; at the large size, after the first kernel, it never waits (gaps under 2% of a
    kernel's time)."""
    figure = FIGURE.read_text()
    assert "launches slower than kernels, the GPU waits between them" in figure
    assert "after the first, kernels back to back, the GPU never waits" in figure
    for kind in ("silu", "copy"):
        small_gaps, small_spans = gaps_and_spans(profile["traces"]["small"], kind)
        assert min(small_gaps) > max(small_spans), (kind, small_gaps, small_spans)
        large_gaps, large_spans = gaps_and_spans(profile["traces"]["large"], kind)
        later_gaps = large_gaps[1:] if kind == "silu" else large_gaps
        assert max(later_gaps) < 0.02 * min(large_spans), (kind, large_gaps, large_spans)
    assert (profile["traces"]["small"]["n"], profile["traces"]["large"]["n"]) == (2**16, 8192**2)
    assert "$n = 2^16$" in figure and "$n = 8192^2$" in figure


def test_the_section_draws_the_trace_and_names_where_it_was_recorded():
    section = SECTION.read_text()
    assert "#figure(fig-silu-profile()" in section and "#profile.gpu" in section
    assert 'json("/data/silu_profile.json")' in FIGURE.read_text()
