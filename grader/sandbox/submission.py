"""The only code that reads a submission's files: a walk that refuses anything but regular files and folders.

The grader reads a submission in its own process, outside every sandbox, so what it reads must be the student's own
bytes: a symbolic link would hand it (and, through the copy, student code) whatever the link names (the reference, the
grader's /proc/self/environ with the secret seed), a hard link a file from outside the tree, a FIFO or a device an
endless or blocking read. The walk never follows a link: each entry is opened relative to its folder's descriptor
with O_NOFOLLOW and checked again on the opened descriptor, so an entry swapped for a link during the walk is not
followed either. It bounds what it reads (entries, bytes per file and in all, folder depth) before reading past a
bound, and keeps what it read: the copy and the digest are made from those bytes, never from a second read.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

# Left out of every copy and digest, never opened: caches that Python, pytest, hypothesis and git write beside code.
IGNORED_NAMES = ("__pycache__", ".hypothesis", ".pytest_cache", ".git")
IGNORED_SUFFIX = ".pyc"
IGNORED = shutil.ignore_patterns(*IGNORED_NAMES, f"*{IGNORED_SUFFIX}")

# The largest honest submission, the reference, holds 52 files and folders, 0.4 MB in all, 46 KB in its largest file:
# the bounds leave ample room for a student's notes and helpers, and none for a disk-filling copy.
MAX_ENTRIES = 2000
MAX_TOTAL_BYTES = 64 * 2**20
MAX_FILE_BYTES = 16 * 2**20
MAX_DEPTH = 32

# O_NONBLOCK: opening a FIFO that the listing showed as a regular file must not wait for a writer.
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
KINDS = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device file",
    stat.S_IFBLK: "a block device file",
}


class BadSubmission(Exception):
    """A submission the grader will not read; the message names the path: relative to the submission, or the
    submission's own as given when the fault is the folder itself."""


def ignored(name: str) -> bool:
    return name in IGNORED_NAMES or name.endswith(IGNORED_SUFFIX)


def copied(relative: Path) -> bool:
    """Whether a copy of a package holds the file at `relative` (no part of it is an ignored name)."""
    return not any(ignored(part) for part in relative.parts)


def kind_of(mode: int) -> str:
    return KINDS.get(stat.S_IFMT(mode), "neither a regular file nor a folder")


def mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"


@dataclass
class Tree:
    """A submission as read: its folders (each before what it holds) and its files' contents, by relative path."""

    folders: list[PurePosixPath] = field(default_factory=list)
    files: dict[PurePosixPath, bytes] = field(default_factory=dict)

    def digest(self) -> str:
        """SHA-256 over the relative paths and contents of the files, in path order (part by part)."""
        digest = hashlib.sha256()
        for relative in sorted(self.files, key=lambda path: path.parts):
            digest.update(os.fsencode(str(relative)) + b"\0" + self.files[relative] + b"\0")
        return digest.hexdigest()

    def write_to(self, destination: Path) -> Path:
        """Write the tree into `destination`, over what is there, world-readable whatever the source's modes: the
        sandbox's user (another uid at the `uid` level) must read it."""
        for folder in (PurePosixPath("."), *self.folders):
            path = destination / folder
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o755)
        for relative, content in self.files.items():
            path = destination / relative
            path.write_bytes(content)
            path.chmod(0o644)
        return destination


@dataclass
class Inode:
    """A regular file's inode as the walk met it: a link count above the times it was met is a link from outside."""

    first_seen: PurePosixPath
    links: int
    met: int = 0


@dataclass
class Walk:
    """What the walk has seen so far, against the bounds; hard links are judged once the whole tree is seen."""

    tree: Tree
    entries: int = 0
    total_bytes: int = 0
    inodes: dict[tuple[int, int], Inode] = field(default_factory=dict)

    def count_entry(self) -> None:
        self.entries += 1
        if self.entries > MAX_ENTRIES:
            raise BadSubmission(f"the submission holds more than {MAX_ENTRIES} files and folders")

    def count_inode(self, relative: PurePosixPath, status: os.stat_result) -> None:
        self.inodes.setdefault((status.st_dev, status.st_ino), Inode(relative, status.st_nlink)).met += 1

    def refuse_outside_links(self) -> None:
        for inode in self.inodes.values():
            if inode.links > inode.met:
                raise BadSubmission(f"{inode.first_seen} is a hard link to a file outside the submission")


def read(root: Path) -> Tree:
    """The submission at `root`, checked: raises BadSubmission for anything but regular files and folders, or past
    a bound. Ignored names are skipped without being opened."""
    try:
        listed = os.lstat(root)
    except OSError as error:
        raise BadSubmission(f"{root} cannot be read ({error.strerror})") from None
    if not stat.S_ISDIR(listed.st_mode):
        raise BadSubmission(f"{root} is {kind_of(listed.st_mode)}")
    walk = Walk(Tree())
    descriptor = opened(str(root), None, root, listed)
    try:
        read_folder(walk, descriptor, PurePosixPath("."), depth=0)
    finally:
        os.close(descriptor)
    walk.refuse_outside_links()
    return walk.tree


def opened(name: str, folder: int | None, relative: PurePosixPath | Path, listed: os.stat_result) -> int:
    """A descriptor of the entry the listing showed, never through a link, checked to be that same entry."""
    try:
        descriptor = os.open(name, OPEN_FLAGS, dir_fd=folder)
    except OSError as error:
        if error.errno == errno.ELOOP:  # O_NOFOLLOW met a link put there since the listing
            raise BadSubmission(f"{relative} is a symbolic link") from None
        raise BadSubmission(f"{relative} cannot be read ({error.strerror})") from None
    now = os.fstat(descriptor)
    if (now.st_dev, now.st_ino, stat.S_IFMT(now.st_mode)) != (listed.st_dev, listed.st_ino,
                                                                stat.S_IFMT(listed.st_mode)):
        os.close(descriptor)
        raise BadSubmission(f"{relative} changed while the submission was read")
    return descriptor


def read_folder(walk: Walk, folder: int, relative: PurePosixPath, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise BadSubmission(f"the submission nests folders more than {MAX_DEPTH} deep ({relative})")
    with os.scandir(folder) as entries:
        for entry in entries:
            walk.count_entry()
            if not ignored(entry.name):
                read_entry(walk, folder, entry.name, relative / entry.name, depth)


def read_entry(walk: Walk, folder: int, name: str, relative: PurePosixPath, depth: int) -> None:
    try:
        listed = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except OSError as error:  # gone since the listing
        raise BadSubmission(f"{relative} cannot be read ({error.strerror})") from None
    if not (stat.S_ISREG(listed.st_mode) or stat.S_ISDIR(listed.st_mode)):
        # Refused unopened: opening a device file can act on the device.
        raise BadSubmission(f"{relative} is {kind_of(listed.st_mode)}")
    descriptor = opened(name, folder, relative, listed)
    try:
        if stat.S_ISDIR(listed.st_mode):
            walk.tree.folders.append(relative)
            read_folder(walk, descriptor, relative, depth + 1)
        else:
            walk.count_inode(relative, listed)
            walk.tree.files[relative] = read_file(walk, descriptor, relative, listed.st_size)
    finally:
        os.close(descriptor)


def read_file(walk: Walk, descriptor: int, relative: PurePosixPath, size_listed: int) -> bytes:
    """The file's content: refused unread when its size is past a bound, and read one byte past the tighter bound
    at most, so that a file that grows, or holds more than its size says, is stopped there."""
    left_in_total = MAX_TOTAL_BYTES - walk.total_bytes
    check_size(size_listed, left_in_total, relative)
    bound = min(MAX_FILE_BYTES, left_in_total)
    chunks, size = [], 0
    while size <= bound:
        chunk = os.read(descriptor, min(bound + 1 - size, 2**20))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    check_size(size, left_in_total, relative)
    walk.total_bytes += size
    return b"".join(chunks)


def check_size(size: int, left_in_total: int, relative: PurePosixPath) -> None:
    if size > MAX_FILE_BYTES:
        raise BadSubmission(f"{relative} is larger than {mib(MAX_FILE_BYTES)}")
    if size > left_in_total:
        raise BadSubmission(f"the submission holds more than {mib(MAX_TOTAL_BYTES)}")
