"""Messages between the grader and its worker processes.

Every message is a torch.save of plain data (tensors, numbers, strings, lists, tuples, dicts). The receiver loads it
with weights_only=True, which unpickles only those types: a worker cannot make the grader run code by returning a
crafted object.

What comes back from student processes (a worker's replies, a rank's result file, their logs) is bounded before the
grader holds it: student code in those processes can write any bytes there, and a small message can stand for a huge
value, through a deflated tensor storage that torch.load inflates (1.6 MB read as 1.6 GB) or through pickle's shared
references (a list holding the same list a thousand times, a thousand levels deep). The grader's own messages to them
are not bounded.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import re
import stat
import zipfile
from pathlib import Path

import torch

# The limits on one reply. In a ci-profile grading of every problem, the reference's largest reply is 6.3 MB (a rank's
# result in parallel.fsdp), and the most any reply holds is 6.3 KB of pickle, 392 values and 1.6 KB of text. On a GPU
# the grading profile draws inputs 32 times the ci sizes in each dimension: the largest reply its strategies allow is
# kernels.rmsnorm's output and input gradient at 8192 x 2048 float32, 134 MB. Each limit is at least four times those.
MAX_REPLY_BYTES = 512 * 2**20  # the message or file as sent
MAX_REPLY_PICKLE_BYTES = 4 * 2**20  # the archive's entries but tensor storages: what unpickling builds objects from
MAX_REPLY_VALUES = 100_000  # containers, numbers, strings and tensors in the decoded value
MAX_REPLY_TEXT_CHARS = 4 * 2**20  # characters of its strings
MAX_REPLY_TENSOR_BYTES = MAX_REPLY_BYTES  # its tensors' elements, numel x element size
# How much of the end of a file a student process writes (its log, its progress) the grader reads.
TAIL_BYTES = 64 * 2**10

# A tensor storage's entry in a torch.save archive: "<archive>/data/<key>".
STORAGE_ENTRY = re.compile(r"/data/\d+$")


class ReplyRefused(Exception):
    """A reply past the limits, refused before the grader holds more of it than the limits allow."""


def to_plain(value):
    """Student return values as plain data: NamedTuples become tuples, tensors are detached plain tensors."""
    if isinstance(value, torch.Tensor):
        return value.detach().as_subclass(torch.Tensor)
    if isinstance(value, tuple):
        return tuple(to_plain(v) for v in value)
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return value
    return f"<unsupported return value of type {type(value).__name__}>"


def encode(message) -> bytes:
    buffer = io.BytesIO()
    torch.save(message, buffer)
    return buffer.getvalue()


def decode(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True, map_location=None)


def decode_reply(data: bytes):
    """A message from a student process, decoded only if it is within the limits; ReplyRefused says why not."""
    if len(data) > MAX_REPLY_BYTES:
        raise ReplyRefused(too_long(len(data), MAX_REPLY_BYTES))
    check_archive(data)
    try:
        value = decode(data)
    except Exception as error:  # noqa: BLE001 - written by student code: any unpickling error may come
        raise ReplyRefused(f"a reply that does not load ({type(error).__name__}: {error})") from None
    check_decoded(value)
    return value


def too_long(size: int, limit: int) -> str:
    return f"a reply of {size:,} bytes, over the limit of {limit:,}"


def check_archive(data: bytes) -> None:
    """The archive's entries, from its directory, before anything is unpickled or inflated: torch.save stores every
    entry as it is, so an entry that is compressed, or larger than the message, is a reply made to inflate."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            entries = archive.infolist()
    except Exception as error:  # noqa: BLE001 - written by student code: any malformed archive may come
        raise ReplyRefused(f"a reply that is not a torch.save archive ({error})") from None
    compressed = [entry.filename for entry in entries if entry.compress_type != zipfile.ZIP_STORED]
    if compressed:
        raise ReplyRefused(f"a reply whose archive holds compressed entries ({', '.join(compressed[:3])}), which "
                           "torch.save never writes: they would be inflated when read")
    declared = sum(entry.file_size for entry in entries)
    if declared > len(data):
        raise ReplyRefused(f"a reply of {len(data):,} bytes whose archive declares {declared:,} bytes of entries")
    pickled = sum(entry.file_size for entry in entries if not STORAGE_ENTRY.search(entry.filename))
    if pickled > MAX_REPLY_PICKLE_BYTES:
        raise ReplyRefused(f"a reply with {pickled:,} bytes of pickled objects, over the limit of "
                           f"{MAX_REPLY_PICKLE_BYTES:,}")


def check_decoded(value) -> None:
    """The decoded value as anything that walks it (a copy, a repr, a join) would find it: a value shared by reference
    counts each time it is reached. The walk stops at the first limit passed, so a structure that refers to itself,
    or shares one list a million times over, costs no more than the limits."""
    values, text_chars, tensor_bytes = 1, 0, 0
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            tensor_bytes += item.numel() * item.element_size()
        elif isinstance(item, (str, bytes, bytearray)):
            text_chars += len(item)
        elif isinstance(item, (dict, list, tuple, set, frozenset)):
            # Counted before they are queued: the queue never holds more than the limit.
            values += 2 * len(item) if isinstance(item, dict) else len(item)
            if values <= MAX_REPLY_VALUES:
                pending.extend([*item.keys(), *item.values()] if isinstance(item, dict) else item)
        if values > MAX_REPLY_VALUES:
            raise ReplyRefused(f"a reply of more than {MAX_REPLY_VALUES:,} values, counting each shared one every "
                               "time it is reached")
        if text_chars > MAX_REPLY_TEXT_CHARS:
            raise ReplyRefused(f"a reply with more than {MAX_REPLY_TEXT_CHARS:,} characters of text, counting each "
                               "shared string every time it is reached")
        if tensor_bytes > MAX_REPLY_TENSOR_BYTES:
            raise ReplyRefused(f"a reply with more than {MAX_REPLY_TENSOR_BYTES:,} bytes of tensor elements, counting "
                               "each shared tensor every time it is reached")


def open_written_by_student(path: Path):
    """A file in a folder student code can write, opened for reading without following a link: a link there would
    have the grader read, with its own rights, whatever it names (the reference, the grader's /proc/self/environ).
    OSError for a link or anything but a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return os.fdopen(fd, "rb")


def read_reply_file(path: Path) -> bytes:
    """A reply written to a file, read only if it is within the byte limit; of a file that grows while it is read, at
    most one byte past the limit is read."""
    with open_written_by_student(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        data = handle.read(MAX_REPLY_BYTES + 1) if size <= MAX_REPLY_BYTES else b""
    size = max(size, len(data))
    if size > MAX_REPLY_BYTES:
        raise ReplyRefused(too_long(size, MAX_REPLY_BYTES))
    return data


def read_tail(path: Path) -> str:
    """The end of a file a student process wrote, its log say: the last TAIL_BYTES (the file may hold gigabytes)."""
    with open_written_by_student(path) as handle:
        handle.seek(max(0, os.fstat(handle.fileno()).st_size - TAIL_BYTES))
        return handle.read(TAIL_BYTES).decode(errors="replace")
