"""A submission is regular files and folders, nothing else: grader.sandbox.submission refuses links, hard links to
files outside the tree, FIFOs, sockets, devices and trees past its bounds, naming the path; `pytest grader`,
`submit`, `grade-all` and Gradescope's run_autograder then grade nothing of it (and, for grade-all, the rest of the
class as usual).

The hostile trees are built here: a link checked into git would be a link in every checkout, and most of these
entries (FIFOs, sockets, devices, hard links) cannot be checked in at all.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import uuid
from pathlib import Path, PurePosixPath

import pytest

from grader.cluster import grade_all
from grader.cluster.jobs import ClusterOptions
from grader.cluster.submit import exit_status, submit
from grader.release import gradescope
from grader.sandbox import submission
from grader.sandbox.submission import BadSubmission
from tests.grading import ROOT
from tests.test_gradescope import run_autograder

REFERENCE_SOFTMAX = ROOT / "reference" / "kernels" / "softmax.py"


@pytest.fixture
def tree(tmp_path) -> Path:
    """A small honest submission: two families' folders with a module each."""
    root = tmp_path / "impl"
    for relative, text in {"__init__.py": "", "kernels/softmax.py": "x = 1\n", "moe/router.py": "y = 2\n"}.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    return root


def refusal(root: Path) -> str:
    with pytest.raises(BadSubmission) as refused:
        submission.read(root)
    return str(refused.value)


# --- what the walk refuses -----------------------------------------------------------------------------------------


def test_link_to_a_file(tree):
    (tree / "kernels" / "softmax.py").unlink()
    (tree / "kernels" / "softmax.py").symlink_to(REFERENCE_SOFTMAX)
    assert refusal(tree) == "kernels/softmax.py is a symbolic link"


def test_link_to_a_folder(tree):
    (tree / "attention").symlink_to(ROOT / "reference" / "attention", target_is_directory=True)
    assert refusal(tree) == "attention is a symbolic link"


def test_dangling_link(tree):
    (tree / "moe" / "notes.txt").symlink_to(tree / "nowhere")
    assert refusal(tree) == "moe/notes.txt is a symbolic link"


def test_links_to_the_graders_own_process(tree):
    (tree / "moe" / "router.py").unlink()
    (tree / "moe" / "router.py").symlink_to("/proc/self/environ")
    assert refusal(tree) == "moe/router.py is a symbolic link"


def test_submission_folder_that_is_a_link(tree, tmp_path):
    link = tmp_path / "linked"
    link.symlink_to(tree, target_is_directory=True)
    assert refusal(link) == f"{link} is a symbolic link"


def test_hard_link_to_a_file_outside(tree, tmp_path):
    outside = tmp_path / "private.py"
    outside.write_text("SECRET = 1\n")
    os.link(outside, tree / "kernels" / "private.py")
    assert refusal(tree) == "kernels/private.py is a hard link to a file outside the submission"


def test_hard_links_inside_the_tree_are_files(tree):
    os.link(tree / "kernels" / "softmax.py", tree / "moe" / "softmax_again.py")
    files = submission.read(tree).files
    assert files[PurePosixPath("moe/softmax_again.py")] == files[PurePosixPath("kernels/softmax.py")] == b"x = 1\n"


def test_fifo(tree):
    os.mkfifo(tree / "kernels" / "pipe")
    assert refusal(tree) == "kernels/pipe is a FIFO"


def test_socket(tree, monkeypatch):
    monkeypatch.chdir(tree / "kernels")  # a socket's path must fit in 108 bytes: bound by its relative name
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind("listening")
        assert refusal(tree) == "kernels/listening is a socket"


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device file takes root")
def test_device_file(tree):
    os.mknod(tree / "kernels" / "zero", stat.S_IFCHR | 0o666, os.makedev(1, 5))  # /dev/zero's numbers
    assert refusal(tree) == "kernels/zero is a character device file"


def test_a_link_swapped_in_after_the_listing_is_not_followed(tree):
    """The walk lists an entry, then opens it: an entry replaced by a link in between is refused, not followed."""
    target = tree / "kernels" / "softmax.py"
    listed = os.stat(target, follow_symlinks=False)
    target.unlink()
    target.symlink_to(REFERENCE_SOFTMAX)
    folder = os.open(tree / "kernels", os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(BadSubmission, match=r"^kernels/softmax.py is a symbolic link$"):
            submission.opened("softmax.py", folder, PurePosixPath("kernels/softmax.py"), listed)
    finally:
        os.close(folder)


# --- bounds --------------------------------------------------------------------------------------------------------


def test_too_many_files(tree):
    many = tree / "many"
    many.mkdir()
    for number in range(submission.MAX_ENTRIES):
        (many / f"{number}.txt").touch()
    assert refusal(tree) == f"the submission holds more than {submission.MAX_ENTRIES} files and folders"


def sparse_file(path: Path, size: int) -> None:
    """A file of `size` bytes that takes no disk: the bounds must hold whatever the disk holds."""
    with open(path, "wb") as handle:
        handle.truncate(size)


def test_a_file_over_the_per_file_bound(tree):
    sparse_file(tree / "kernels" / "weights.bin", submission.MAX_FILE_BYTES + 1)
    assert refusal(tree) == f"kernels/weights.bin is larger than {submission.MAX_FILE_BYTES // 2**20} MiB"


def test_too_many_bytes_in_all(tree):
    for number in range(submission.MAX_TOTAL_BYTES // submission.MAX_FILE_BYTES + 1):
        sparse_file(tree / "moe" / f"part{number}.bin", submission.MAX_FILE_BYTES)
    assert refusal(tree) == f"the submission holds more than {submission.MAX_TOTAL_BYTES // 2**20} MiB"


def test_folders_nested_too_deep(tree):
    deep = tree.joinpath(*["d"] * (submission.MAX_DEPTH + 1))
    deep.mkdir(parents=True)
    assert refusal(tree).startswith(f"the submission nests folders more than {submission.MAX_DEPTH} deep")


def test_the_reference_is_well_within_the_bounds():
    read = submission.read(ROOT / "reference")
    assert len(read.files) + len(read.folders) < submission.MAX_ENTRIES // 10
    assert sum(map(len, read.files.values())) < submission.MAX_TOTAL_BYTES // 10


# --- copy and digest -----------------------------------------------------------------------------------------------


def add_ignored(tree: Path) -> None:
    """The caches left beside code, some of them hostile: an ignored name is skipped unopened, whatever it is."""
    (tree / "kernels" / "__pycache__").mkdir()
    (tree / "kernels" / "__pycache__" / "softmax.cpython-311.pyc").write_bytes(b"\0")
    (tree / "moe" / "router.pyc").write_bytes(b"\0")
    (tree / ".git").symlink_to("/proc/self", target_is_directory=True)
    os.mkfifo(tree / ".hypothesis")
    (tree / "moe" / ".pytest_cache").symlink_to(tree / "nowhere")


def test_ignored_names_are_neither_copied_nor_digested(tree, tmp_path):
    clean = submission.read(tree).digest()
    add_ignored(tree)
    read = submission.read(tree)
    assert read.digest() == clean
    copy = read.write_to(tmp_path / "copy")
    held = sorted(str(path.relative_to(copy)) for path in copy.rglob("*"))
    assert held == ["__init__.py", "kernels", "kernels/softmax.py", "moe", "moe/router.py"]


def test_digest_is_over_relative_paths_and_contents_in_path_order(tmp_path):
    root = tmp_path / "impl"
    (root / "a").mkdir(parents=True)
    (root / "a" / "b").write_bytes(b"1")
    (root / "a.b").write_bytes(b"2")
    expected = hashlib.sha256(b"a/b\x001\x00" + b"a.b\x002\x00").hexdigest()  # "a" before "a.b", part by part
    assert submission.read(root).digest() == expected


def test_copies_are_readable_by_everyone_whatever_the_modes(tree, tmp_path):
    (tree / "kernels" / "softmax.py").chmod(0o600)
    (tree / "moe" / "run.sh").write_text("#!/bin/sh\n")
    (tree / "moe" / "run.sh").chmod(0o4755)
    (tree / "moe").chmod(0o700)
    copy = submission.read(tree).write_to(tmp_path / "copy")
    modes = {str(path.relative_to(copy)): stat.S_IMODE(path.stat().st_mode) for path in [copy, *copy.rglob("*")]}
    assert modes == {".": 0o755, "__init__.py": 0o644, "kernels": 0o755, "kernels/softmax.py": 0o644,
                     "moe": 0o755, "moe/router.py": 0o644, "moe/run.sh": 0o644}


# --- the commands that read a submission ---------------------------------------------------------------------------


def test_submit_sends_no_job_for_a_bad_submission(tree, tmp_path):
    (tree / "kernels" / "softmax.py").unlink()
    (tree / "kernels" / "softmax.py").symlink_to(REFERENCE_SOFTMAX)
    said = []
    result = submit(tree, "reference", ClusterOptions("local"), tmp_path / "work", tmp_path / "results.json",
                    report=said.append)
    assert said == ["not graded: kernels/softmax.py is a symbolic link"]
    assert exit_status(result) == 2
    assert not (tmp_path / "work").exists() and not (tmp_path / "results.json").exists()


def test_grade_all_finds_links_without_following_them(tree, tmp_path):
    submissions = tmp_path / "submissions"
    submissions.mkdir()
    tree.rename(submissions / "alice")
    (submissions / "eve").symlink_to(submissions / "alice", target_is_directory=True)
    (submissions / "notes.txt").write_text("not a submission\n")
    found = grade_all.submissions_in(submissions, tmp_path / "out")
    assert [s.student for s in found] == ["alice", "eve"]
    out = tmp_path / "out" / "eve"
    out.mkdir(parents=True)
    (out / "results.json").write_text("{}")
    (out / "submission.sha256").write_text(submission.read(submissions / "alice").digest())
    assert not found[1].up_to_date()  # graded again, and refused there


def test_gradescope_looks_for_the_implementation_through_no_link(tree, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    tree.rename(elsewhere / "student_impl")
    upload = tmp_path / "upload"
    upload.mkdir()
    (upload / "repo").symlink_to(elsewhere, target_is_directory=True)
    assert gradescope.implementation_in(upload) is None  # repo/student_impl is there only through the link
    (upload / "student_impl").symlink_to(elsewhere / "student_impl", target_is_directory=True)
    assert gradescope.implementation_in(upload) == upload / "student_impl"  # taken, for the check to refuse


# --- end to end ----------------------------------------------------------------------------------------------------


def reference_copy(destination: Path) -> Path:
    shutil.copytree(ROOT / "reference", destination, ignore=submission.IGNORED)
    return destination


def replace_with_link(path: Path, target: str | Path) -> None:
    path.unlink()
    path.symlink_to(target)


def test_pytest_grader_stops_at_a_link(tmp_path):
    impl = reference_copy(tmp_path / "impl")
    replace_with_link(impl / "kernels" / "softmax.py", REFERENCE_SOFTMAX)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "grader", "-q", "-p", "no:cacheprovider", "--impl", str(impl),
         "--profile", "ci", "--problem", "kernels.softmax", "-k", "matches_reference_fp32"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ERROR: not graded: kernels/softmax.py is a symbolic link" in done.stderr


def test_grade_all_grades_the_class_around_bad_submissions(tmp_path):
    submissions = tmp_path / "submissions"
    reference_copy(submissions / "honest")
    replace_with_link(reference_copy(submissions / "environ") / "moe" / "router.py", "/proc/self/environ")
    (reference_copy(submissions / "dangling") / "moe" / "notes.txt").symlink_to(tmp_path / "nowhere")
    out, marker = tmp_path / "out", uuid.uuid4().hex
    done = subprocess.run(
        [sys.executable, "-m", "grader", "grade-all", str(submissions), "--out", str(out), "--executor", "local",
         "--profile", "ci", "--problems", "moe.router", "--select", "indices_and_gates"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "GRADER_TEST_MARKER": marker},
    )
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]  # not every submission was graded
    rows = {row["student"]: row for row in csv.DictReader(open(out / "class.csv"))}
    assert rows["environ"]["status"] == "not graded: moe/router.py is a symbolic link", rows
    assert rows["dangling"]["status"] == "not graded: moe/notes.txt is a symbolic link", rows
    assert rows["honest"]["status"] == "graded", rows
    results = json.loads((out / "honest" / "results.json").read_text())
    assert results["tests"] and results["score"] == sum(test["max_score"] for test in results["tests"])
    assert "environ: not graded: moe/router.py is a symbolic link" in (out / "summary.txt").read_text()
    assert not (out / "environ" / "runs").exists() and not (out / "dangling" / "runs").exists()
    assert not any(marker.encode() in path.read_bytes() for path in out.rglob("*") if path.is_file())


def test_gradescope_grades_nothing_of_an_upload_with_a_link(tmp_path):
    zip_path = gradescope.build(tmp_path / "autograder.zip", "public", ["moe.accounting"])
    root = tmp_path / "autograder"

    def upload(folder: Path) -> None:
        impl = reference_copy(folder / "student_impl")
        replace_with_link(impl / "moe" / "accounting.py", root / "source" / "reference" / "moe" / "accounting.py")

    results = run_autograder(zip_path, root, upload)
    assert results["score"] == 0 and results["tests"] == []
    assert results["output"] == "Not graded: moe/accounting.py is a symbolic link"
