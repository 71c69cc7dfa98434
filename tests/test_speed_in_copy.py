"""Speed points in the students' copy, which has no reference: the student's time against the baseline, turned into
"x the reference" by the ratio stored per GPU model (grader.speed.grading, grader.speed.ratios).

Timing needs a GPU; here the parts around it are checked: the shipped ratios cover every single-GPU speed case and
were measured with the reference and speed tests of this tree, the oracle the copy checks moe.moe_layer's timed
output against agrees with the reference, and the copy runs its speed tests in a process that sees the GPUs it hid
from the rest of its grading."""

from __future__ import annotations

import json
import os
import shutil
import tokenize
from pathlib import Path

import pytest
import torch

from assignment.registry import PROBLEMS
from grader.expectations import students_copy
from grader.session.packages import PackageSpec, load_problem_module
from grader.speed import ratios as speed_ratios
from grader.speed.grading import RATIOS_FILE, check_sample, stored_ratio
from grader.speed.timing import sample
from tests.grading import ROOT, run_grader

MEASURED_ON = "NVIDIA H200"


def single_gpu_speed_problems():
    return [(problem, spec) for problem in PROBLEMS if problem.speed
            for spec in [speed_ratios.speed_spec(problem.id)] if spec is not None]


# Speed cases whose ratios are still to be measured on the GPU: their speed lines in the copy are advisory until then.
# Strict: once measured, the mark must go.
NOT_YET_MEASURED: set[str] = set()
# Problems whose copy checks a timed output against the recurrence run step by step on the device.
RECURRENCE_ORACLE = ("attention.gated_deltanet", "attention.linear_attention", "attention.mamba2")
# Problems whose copy checks a timed output against the attention formula written out at the sampled positions, each
# with the small case it is checked on, in its own order of dimensions: (batch, heads, seq, head_dim, window) for the
# sliding window, (batch, seq, heads, head_dim, topk) for sparse DSA.
FORMULA_ORACLE_SHAPES = {
    "attention.sliding_window": (2, 3, 40, 16, 7),
    "attention.sparse_dsa": (2, 40, 3, 16, 7),
}


def ratio_case(problem):
    not_measured = pytest.mark.xfail(strict=True, reason="its ratios are not yet measured on the GPU")
    return pytest.param(problem, id=problem.id, marks=[not_measured] if problem.id in NOT_YET_MEASURED else [])


@pytest.mark.parametrize("problem", [ratio_case(problem) for problem, _ in single_gpu_speed_problems()])
def test_the_stored_ratios_cover_every_speed_case_and_are_current(problem):
    """A changed reference kernel or speed test needs its ratios measured again on the GPU (python -m grader
    speed_ratios), or the release leaves them out and the copy's speed line is advisory."""
    for case in problem.speed.cases():
        ratio, missing = stored_ratio(MEASURED_ON, problem.id, case)
        assert ratio is not None and 0.05 < ratio < 20, missing
    ratios = json.loads(RATIOS_FILE.read_text())
    stale = speed_ratios.stale_problems(ratios, PackageSpec("reference", ROOT / "reference"))
    assert problem.id not in stale.get(MEASURED_ON, []), f"measured with another reference or speed test: {stale}"


def test_an_unknown_gpu_has_no_ratio_and_says_which_are_stored():
    ratio, missing = stored_ratio("NVIDIA GeForce RTX 4090", "kernels.gelu", ((8192, 8192), "float32"))
    assert ratio is None and MEASURED_ON in missing and "RTX 4090" in missing


def test_a_changed_speed_test_makes_its_ratios_stale():
    ratios = json.loads(RATIOS_FILE.read_text())
    ratios["gpus"][MEASURED_ON]["problems"]["kernels.gelu"]["digests"]["grader"] = "0" * 64
    kept, stale = speed_ratios.without_stale(ratios, PackageSpec("reference", ROOT / "reference"))
    assert stale == {MEASURED_ON: ["kernels.gelu"]}
    assert "kernels.gelu" not in kept["gpus"][MEASURED_ON]["problems"]
    assert "kernels.softmax" in kept["gpus"][MEASURED_ON]["problems"]


def test_measuring_some_problems_keeps_the_gpus_other_ratios(tmp_path, monkeypatch):
    """Ratios of one problem measured again replace that problem's alone, where the versions and calls are those
    the GPU's other ratios were measured with; with other versions, the GPU's ratios start afresh."""
    out = tmp_path / "ratios.json"
    shutil.copy(RATIOS_FILE, out)
    stored = json.loads(out.read_text())["gpus"][MEASURED_ON]
    measured = {"kernels.gelu": {"cases": {}, "digests": {}}}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: MEASURED_ON)
    monkeypatch.setattr(speed_ratios, "measure_gpu", lambda reference, problem_ids, calls: measured.items())
    monkeypatch.setattr(speed_ratios, "versions", lambda: stored["versions"])
    speed_ratios.measure_into(out, PackageSpec("reference", ROOT / "reference"), ["kernels.gelu"], stored["calls"])
    problems = json.loads(out.read_text())["gpus"][MEASURED_ON]["problems"]
    assert problems == {**stored["problems"], **measured}
    monkeypatch.setattr(speed_ratios, "versions", lambda: {**stored["versions"], "triton": "0.0"})
    speed_ratios.measure_into(out, PackageSpec("reference", ROOT / "reference"), ["kernels.gelu"], stored["calls"])
    assert json.loads(out.read_text())["gpus"][MEASURED_ON]["problems"] == measured


def test_passes_combine_case_by_case_at_the_median_ratio(tmp_path):
    """Three passes of one GPU: each case keeps the pass of its median ratio (its times with it); a problem whose
    digests differ in one pass is left out; the result goes over the stored file, other problems kept."""
    stored = json.loads(RATIOS_FILE.read_text())
    entry = stored["gpus"][MEASURED_ON]

    def a_pass(gelu_ratios: list[float], softmax_digest: str = "") -> dict:
        problems = json.loads(json.dumps(entry["problems"]))
        for ratio, case in zip(gelu_ratios, problems["kernels.gelu"]["cases"].values(), strict=True):
            case.update(reference_ms=ratio, baseline_ms=1.0, reference_over_baseline=ratio)
        if softmax_digest:
            problems["kernels.softmax"]["digests"]["reference"] = softmax_digest
        return {"format": 1, "gpus": {MEASURED_ON: {**entry, "problems": problems}}}

    cases = len(entry["problems"]["kernels.gelu"]["cases"])
    passes = [a_pass([0.9] * cases), a_pass([0.7] * (cases - 1) + [1.2]), a_pass([0.8] * cases, softmax_digest="0")]
    combined = speed_ratios.median_of(passes)["gpus"][MEASURED_ON]["problems"]
    gelu = list(combined["kernels.gelu"]["cases"].values())
    assert [case["reference_over_baseline"] for case in gelu] == [0.8] * (cases - 1) + [0.9]
    assert all(case["reference_ms"] == case["reference_over_baseline"] for case in gelu)
    assert "kernels.softmax" not in combined and combined["kernels.gelu"]["passes"] == 3
    out = tmp_path / "ratios.json"
    shutil.copy(RATIOS_FILE, out)
    assert speed_ratios.main([str(out), "--median-of", *map(str, write_each(tmp_path, passes))]) == 0
    problems = json.loads(out.read_text())["gpus"][MEASURED_ON]["problems"]
    assert problems["kernels.softmax"] == entry["problems"]["kernels.softmax"]
    assert problems["kernels.gelu"] == combined["kernels.gelu"]


def write_each(folder: Path, passes: list[dict]) -> list[Path]:
    paths = [folder / f"pass{number}.json" for number in range(len(passes))]
    for path, content in zip(paths, passes, strict=True):
        path.write_text(json.dumps(content))
    return paths


def test_the_moe_layer_oracle_agrees_with_the_reference():
    """On a small case in float32: every judged position equals the reference's output; few are left unjudged."""
    spec = speed_ratios.speed_spec("moe.moe_layer")
    reference = load_problem_module(PackageSpec("reference", ROOT / "reference"), "moe.moe_layer")
    args = spec.inputs((96, 32, 24, 8, 3, 2), "float32", seed=5, device=torch.device("cpu"))
    output = spec.harness(reference.moe_layer, *args)
    for seed in range(3):
        expected = spec.oracle(args, seed)
        judged = ~expected.isnan()
        assert judged.float().mean() > 0.9
        torch.testing.assert_close(expected[judged], sample(output, seed)[judged], rtol=1e-5, atol=1e-5)
        check_sample(sample(output, seed), expected, torch.float32, "the reference's output")
        with pytest.raises(Exception, match="differs from the expected one"):
            check_sample(sample(output * 1.01, seed), expected, torch.float32, "a wrong output")


@pytest.mark.parametrize("problem_id", RECURRENCE_ORACLE)
def test_the_linear_attention_oracles_agree_with_the_reference(problem_id):
    """The copy checks a timed chunked output against the recurrence run step by step on the device: on a small case
    in float32, it equals the reference's recurrent form at every sampled position, and a wrong output fails."""
    spec = speed_ratios.speed_spec(problem_id)
    reference = load_problem_module(PackageSpec("reference", ROOT / "reference"), problem_id)
    args = spec.inputs((2, 3, 40, 16), "float32", seed=5, device=torch.device("cpu"))
    tensors = [a.detach() for a in args if a.requires_grad]
    result = getattr(reference, spec.function.replace("_chunked", "_recurrent"))(*tensors)
    output = result[0] if isinstance(result, tuple) else result
    for seed in range(3):
        expected = spec.oracle(args, seed)
        torch.testing.assert_close(expected, sample(output, seed), rtol=1e-5, atol=1e-5)
        check_sample(sample(output, seed), expected, torch.float32, "the reference's output")
        with pytest.raises(Exception, match="differs from the expected one"):
            check_sample(sample(output * 1.01, seed), expected, torch.float32, "a wrong output")


@pytest.mark.parametrize("problem_id", FORMULA_ORACLE_SHAPES)
def test_the_sliding_window_and_sparse_oracles_agree_with_the_formula(problem_id):
    """The copy checks a timed sliding-window output row by row, and a sparse-attention one from each sampled query's
    selected keys: on a small case in float32 each equals the written-out formula at every sampled position, and a
    wrong output fails."""
    spec = speed_ratios.speed_spec(problem_id)
    reference = load_problem_module(PackageSpec("reference", ROOT / "reference"), problem_id)
    args = spec.inputs(FORMULA_ORACLE_SHAPES[problem_id], "float32", seed=5, device=torch.device("cpu"))
    # The fourth input says which keys each query sees: the window, or each query's selected key indices.
    q, k, v, keys_seen, _ = args
    output, _ = getattr(reference, spec.function + "_torch")(q.detach(), k.detach(), v.detach(), keys_seen)
    for seed in range(3):
        expected = spec.oracle(args, seed)
        torch.testing.assert_close(expected, sample(output, seed), rtol=1e-5, atol=1e-5)
        with pytest.raises(Exception, match="differs from the expected one"):
            check_sample(sample(output * 1.01, seed), expected, torch.float32, "a wrong output")


def test_the_gpu_lane_sees_the_gpus_the_copy_hid(monkeypatch, tmp_path):
    monkeypatch.setattr(students_copy, "RELEASE_FOLDER", tmp_path)
    monkeypatch.setattr(students_copy, "_hidden", students_copy._NOT_SET)
    monkeypatch.delenv(students_copy.GPU_LANE_VARIABLE, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    students_copy.hide_gpus_in_students_copy()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    lane = students_copy.gpu_lane_environment()
    assert lane["CUDA_VISIBLE_DEVICES"] == "2,3" and lane[students_copy.GPU_LANE_VARIABLE] == "1"
    monkeypatch.setenv(students_copy.GPU_LANE_VARIABLE, "1")  # the lane itself hides nothing
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    students_copy.hide_gpus_in_students_copy()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_the_copy_grades_speed_in_a_second_process(students_copy, tmp_path):
    """With --gpu-lane on (as where this machine has GPUs), the speed tests run after the others in the GPU lane and
    count in the same table: here, with no GPU in it either, they skip there as they would have here."""
    impl = shutil.copytree(ROOT / "reference", tmp_path / "solution")
    tests = [f"grader/kernels/test_softmax.py::test_{group}" for group in ("speed", "matches_reference_fp32")]
    runs = {choice: run_grader(impl, "--gpu-lane", choice, tests=tests, cwd=students_copy) for choice in ("on", "off")}
    assert "now run in a second process that sees the GPUs" in runs["on"].output
    assert "second process" not in runs["off"].output
    verdicts = [{t["name"]: (t.get("status"), t["score"], t["max_score"]) for t in run.results["tests"]}
                for run in runs.values()]
    assert verdicts[0] == verdicts[1]
    speed = [t for t in runs["on"].results["tests"] if "test_speed" in t["name"]]
    assert len(speed) == 4 and all(t["output"].startswith("skipped: needs a GPU") for t in speed), speed


def test_an_f_string_is_one_token_on_every_python():
    """The ratios' digests compare code as tokens; Python 3.12 splits an f-string into parts, 3.11 does not. Both
    must read one string, nested fields and a triple-quoted span of lines included, or a digest taken on the GPU
    host would differ from the one the release checks it against."""
    source = 'def f(b, w):\n    return f"a{b!r:>{w}}c" + f"""x\n{f\'{b}\'}y""" + "z"\n'
    strings = [text for kind, text in speed_ratios.python_311_tokens(source) if kind == tokenize.STRING]
    assert strings == ['f"a{b!r:>{w}}c"', 'f"""x\n{f\'{b}\'}y"""', '"z"']
    assert speed_ratios.code_text(source).endswith('return f"a{b!r:>{w}}c" + f"""x\n{f\'{b}\'}y""" + "z"')
