"""`pytest grader --dump-failing DIR`: the first failing call of a problem, saved with a snippet that reruns it."""

from __future__ import annotations

import subprocess
import sys

import torch

from tests import mutants
from tests.grading import run_grader

# Run the snippet as a script would be, then say what it left in `output` and what it was called on.
RUN_SNIPPET = ("import runpy, sys, torch; ran = runpy.run_path(sys.argv[1]); x = ran['call']['args'][0]; "
               "torch.save({'x': x, 'output': ran['output']}, sys.argv[2])")


def test_the_snippet_calls_the_wrong_function_on_the_failing_input(tmp_path):
    mutant = next(m for m in mutants.discover() if m.id == "kernels.gelu/erf_instead_of_tanh")
    impl = mutants.materialise([mutant], tmp_path / "wrong")
    folder = tmp_path / "dumped"
    run = run_grader(impl, "--problem", "kernels.gelu", "-k", "matches_reference_fp", "--dump-failing", str(folder))
    failed = [t["name"] for t in run.failures("kernels.gelu")]
    assert failed[:1] == ["kernels.gelu :: test_matches_reference_fp32"], run.output[-3000:]
    stem = "kernels.gelu__test_matches_reference_fp32"
    # The first failure of the problem only, as two regular files and nothing else.
    assert sorted(path.name for path in folder.iterdir()) == [f"{stem}.pt", f"{stem}.py"]
    assert all(path.is_file() and not path.is_symlink() for path in folder.iterdir())
    snippet = folder / f"{stem}.py"
    assert len(snippet.read_text().splitlines()) == 3
    assert f"inputs saved: python {snippet}" in run.output

    ran = tmp_path / "ran.pt"
    done = subprocess.run([sys.executable, "-c", RUN_SNIPPET, str(snippet), str(ran)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    values = torch.load(ran)
    x, output = values["x"], values["output"]
    assert x.dtype == torch.float32 and output.shape == x.shape
    # What the wrong module computes (the exact GeLU), not the tanh approximation the contract asks for.
    assert torch.allclose(output, torch.nn.functional.gelu(x), atol=1e-6)
    assert not torch.allclose(output, torch.nn.functional.gelu(x, approximate="tanh"), atol=1e-5)

