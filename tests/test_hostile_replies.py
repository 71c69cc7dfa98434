"""What student processes send back is bounded and inert: a reply is refused before it can inflate in the grader, and
text from student code cannot act on the terminal that shows the grade or on the results file.

The two attacks are graded end to end (each loses its own test's points; moe.router, graded beside it, keeps its
marks); the bounds and the escaping are also tested directly, on crafted replies, files and results.
"""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import socket
import subprocess
import sys
import textwrap
import zipfile
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from assignment.registry import BY_ID
from grader.checks.inert import inert
from grader.ranks.launcher import last_progress, last_words, log_tail, read_reply
from grader.sandbox import wire
from grader.sandbox.client import ReplyConnection, output_tail
from grader.sandbox.wire import ReplyRefused, decode_reply, encode
from grader.session import scoring
from grader.session.report import failure_summary, results_json, score_table
from tests.grading import ATTACKED_AND_BYSTANDER, ROOT, GraderRun, assert_fails_for, run_grader

HOSTILE = Path(__file__).resolve().parent / "hostile"
# What a student's text must never bring to the terminal or the results file unescaped.
RAW_CONTROLS = ("\x1b", "\r", "\x9b", "\u202e")
FORGED_ROW = "\r\x1b[K\x1b[1Gkernels.softmax  passed  16/16"


def hostile_impl(tmp_path: Path, variant: str, problem_file: str = "kernels/softmax.py") -> Path:
    """A copy of the reference with one of its modules replaced by the hostile one."""
    impl = tmp_path / "impl"
    shutil.copytree(ROOT / "reference", impl, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(HOSTILE / variant / problem_file, impl / problem_file)
    return impl


def graded_with_peak_memory(impl: Path, *pytest_args: str) -> tuple[GraderRun, int]:
    """run_grader in a process of its own, whose only child is that grading: the run, and the most resident memory
    (bytes) of the grader or of any process it started and waited for."""
    script = textwrap.dedent("""
        import dataclasses, json, resource, sys
        from tests.grading import run_grader
        run = run_grader(sys.argv[1], *sys.argv[2:])
        peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        print(json.dumps({"run": dataclasses.asdict(run), "peak_kib": peak_kib}))
    """)
    done = subprocess.run([sys.executable, "-c", script, str(impl), *pytest_args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    measured = json.loads(done.stdout.splitlines()[-1])
    return GraderRun(**measured["run"]), measured["peak_kib"] * 1024


def assert_router_unharmed(run: GraderRun) -> None:
    router = run.tests_of("moe.router")
    assert router and all(t["status"] == "passed" for t in router), run.output[-3000:]


def strings_in(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [text for item in value.values() for text in strings_in(item)]
    if isinstance(value, list):
        return [text for item in value for text in strings_in(item)]
    return []


def raw_controls_in(texts: list[str]) -> list[str]:
    return [repr(control) for control in RAW_CONTROLS if any(control in text for text in texts)]


# --- the attacks, graded ----------------------------------------------------------------------------------------------


def test_an_inflating_reply_is_refused_before_it_inflates(tmp_path):
    """The hostile softmax answers over the worker's socket with 1.6 MB that torch.load would read as a 1.6 GB tensor
    (a deflated storage): without the bound, the grader's peak memory was 1.9 GB, against 0.35 GB for an honest run."""
    run, peak_bytes = graded_with_peak_memory(hostile_impl(tmp_path, "inflates_reply"), *ATTACKED_AND_BYSTANDER,
                                              "--source-policy", "off")
    assert_fails_for(run, "kernels.softmax", "matches_reference_fp32", "compressed entries", "refused",
                     "worker was stopped", status="crashed")
    assert_router_unharmed(run)
    assert peak_bytes < 2**30, f"the grading took {peak_bytes / 2**30:.2f} GiB"


def test_control_characters_cannot_redraw_the_score_table(tmp_path):
    """The hostile softmax prints and raises a forged "passed 16/16" row behind a carriage return and ESC [K: its
    test fails, the row says so, and the student's text is shown escaped, in the terminal and in the results file."""
    run = run_grader(hostile_impl(tmp_path, "redraws_table"), *ATTACKED_AND_BYSTANDER, env={"PY_COLORS": "0"})
    assert_fails_for(run, "kernels.softmax", "matches_reference_fp32", "raised Redraw", "passed  16/16")
    assert_router_unharmed(run)
    assert raw_controls_in([run.output]) == [], run.output[-3000:]
    assert raw_controls_in(strings_in(run.results)) == [], run.results
    row = next(line for line in run.results["output"].splitlines() if line.startswith("kernels.softmax"))
    assert row.split()[1:3] == ["failed", "0/5"], row
    assert r"\r\x1b[K\x1b[1Gkernels.softmax" in run.failures("kernels.softmax")[0]["output"]


# --- the bounds on a reply --------------------------------------------------------------------------------------------


def deflated(archive_bytes: bytes) -> bytes:
    """The same torch.save archive with its entries deflated, as torch.save never writes one."""
    source = zipfile.ZipFile(io.BytesIO(archive_bytes))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for entry in source.infolist():
            archive.writestr(entry.filename, source.read(entry))
    return buffer.getvalue()


def test_an_honest_reply_is_decoded_as_it_was():
    reply = {"status": "ok", "value": (torch.arange(12.0).reshape(3, 4), [1, 2.5, None], {"loss": torch.tensor(0.5)}),
             "launches": ["_softmax_kernel"], "forbidden": [], "message": "line one\n\tline two"}
    decoded = decode_reply(encode(reply))
    assert torch.equal(decoded["value"][0], reply["value"][0])
    assert decoded["value"][1:] == reply["value"][1:] and decoded["message"] == reply["message"]


def test_a_deflated_archive_is_refused_before_it_is_read():
    small_on_the_wire = deflated(encode({"status": "ok", "value": torch.zeros(50_000_000, dtype=torch.uint8)}))
    assert len(small_on_the_wire) < 100_000
    with pytest.raises(ReplyRefused, match="compressed entries"):
        decode_reply(small_on_the_wire)


def nested_shared_lists() -> list:
    """10^9 zeros: a thousand references to one list of a thousand references to one list of a thousand zeros."""
    return [[[0] * 1000] * 1000] * 1000


def list_holding_itself() -> list:
    loop = []
    loop.append(loop)
    return loop


def shared_string() -> list[str]:
    return ["x" * 1_000_000] * 100


def expanded_tensor() -> torch.Tensor:
    """4 GiB of elements on 4 bytes of storage."""
    return torch.zeros(1).expand(2**30)


@pytest.mark.parametrize("make_value, limit", [
    (nested_shared_lists, "values"),
    (list_holding_itself, "values"),
    (shared_string, "characters of text"),
    (expanded_tensor, "bytes of tensor elements"),
])
def test_a_small_reply_that_stands_for_a_huge_value_is_refused(make_value, limit):
    message = encode({"status": "ok", "value": make_value()})
    assert len(message) < 2 * 2**20
    with pytest.raises(ReplyRefused, match=limit):
        decode_reply(message)


def test_too_many_bytes_of_pickle_are_refused_before_unpickling(monkeypatch):
    monkeypatch.setattr(wire, "MAX_REPLY_PICKLE_BYTES", 10_000)
    with pytest.raises(ReplyRefused, match="bytes of pickled objects, over the limit of 10,000"):
        decode_reply(encode({"status": "ok", "value": list(range(10_000))}))


def test_a_reply_that_is_no_archive_is_refused():
    with pytest.raises(ReplyRefused, match="not a torch.save archive"):
        decode_reply(b"\x80\x04K\x01.")


def test_a_worker_message_over_the_limit_is_refused_from_its_header():
    ours, theirs = socket.socketpair()
    receiver, sender = ReplyConnection(ours.detach()), Connection(theirs.detach())
    sender.send_bytes(b"x" * 5000)
    with pytest.raises(ReplyRefused, match="a reply of 5,000 bytes, over the limit of 4,096"):
        receiver.recv_bytes(4096)
    assert receiver.poll(0), "the refusal read only the header: the message's body is still there, unread"
    receiver.close()
    sender.close()


def test_a_rank_result_past_the_limits_reads_as_that_ranks_error(tmp_path, monkeypatch):
    monkeypatch.setattr(wire, "MAX_REPLY_BYTES", 4096)
    large = tmp_path / "rank0.result"
    large.write_bytes(b"\0" * 5000)
    inflating = tmp_path / "rank1.result"
    inflating.write_bytes(deflated(encode({"status": "ok", "value": torch.zeros(100_000, dtype=torch.uint8)})))
    for path, why in ((large, "a reply of 5,000 bytes, over the limit of 4,096"), (inflating, "compressed entries")):
        reply = read_reply(path)
        assert reply["status"] == "error" and reply["type_names"] == ["RefusedResult"], reply
        assert why in reply["message"], reply["message"]


def test_files_rank_code_swapped_for_links_are_not_followed(tmp_path):
    """A rank's result, progress and log files lie in a folder its code can write: a link there must not have the
    grader read, with its own rights, the file it names."""
    secret = tmp_path / "secret"
    secret.write_bytes(encode({"status": "ok", "value": "the secret seed is 918273645"}))
    run = tmp_path / "run"
    (run / "shared").mkdir(parents=True)
    for name in ("rank0.result", "rank0.progress", "rank0.log"):
        (run / "shared" / name).symlink_to(secret)
    reply = read_reply(run / "shared" / "rank0.result")
    assert reply["type_names"] == ["CorruptResult"] and "918273645" not in json.dumps(reply), reply
    assert last_progress(run, 0) == (0, "")
    assert log_tail(run / "shared" / "rank0.log") == ""


# --- inert text -------------------------------------------------------------------------------------------------------


def test_control_characters_are_shown_escaped():
    assert inert("a\rb\x1b[Kc\x9bd\u202ee\x00f\x7f\u2028") == r"a\rb\x1b[Kc\x9bd\u202ee\x00f\x7f\u2028"


def test_honest_text_is_unchanged():
    message = ("softmax(x): 3 of 12 values out of tolerance; largest error 0.5 (relative 1) at (0, 1)\n"
               "\tallowed 1e-06 = 2 x reference error ≤ 1 ulp × scale 1 🏖️\nreproduce: pytest grader")
    assert inert(message) == message


def test_long_text_keeps_its_beginning_and_end_and_says_how_much_was_cut():
    text = "start " + "x" * 20_000 + " the error"
    shown = inert(text, limit=1000)
    assert shown.startswith("start ") and shown.endswith(" the error")
    assert f"[... {len(text) - 1000:,} characters cut ...]" in shown
    assert len(shown) < 1100


def test_log_tails_are_read_from_the_end_and_escaped(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text("early line\n" * 200_000 + "progress\r 50%\rdone" + FORGED_ROW + "\nlast line\n")
    tail = output_tail(log)
    assert tail.endswith(r"progress\r 50%\rdone\r\x1b[K\x1b[1Gkernels.softmax  passed  16/16" + "\nlast line")
    assert len(tail.splitlines()) == 15
    log.write_text("chatter\nFatal Python error: Segmentation fault\x1b[K\n\nThread 0x1 (most recent call first):\n")
    assert last_words(log).startswith(r"Fatal Python error: Segmentation fault\x1b[K")


def test_the_score_table_summary_and_results_file_show_student_text_inert():
    """The last guard: a message that reached a result unescaped, by whatever way, is escaped where it is shown."""
    forged = scoring.TestResult(
        "grader/kernels/test_softmax.py::test_matches_reference_fp32", BY_ID["kernels.softmax"],
        "matches_reference_fp32", 5.0, status="failed", message=f"softmax() raised ValueError: {FORGED_ROW}",
        detail=f"[failed] softmax() raised ValueError: {FORGED_ROW}\nreproduce: pytest grader")
    honest = dataclasses.replace(forged, nodeid=forged.nodeid + "[2]", message="softmax(x): wrong shape (3,)",
                                 detail="[failed] softmax(x): wrong shape (3,)\nreproduce: pytest grader")
    results = [forged, honest]
    scores = scoring.by_problem(results)
    shown = [*score_table(scores), *failure_summary(results), *strings_in(results_json(results, scores, 1.0, {}))]
    assert raw_controls_in(shown) == [], shown
    assert any(r"raised ValueError: \r\x1b[K\x1b[1Gkernels.softmax" in line for line in shown), shown
    assert f"{honest.nodeid}  failed: softmax(x): wrong shape (3,)" in "\n".join(shown)
