"""Results files the cluster commands can trust: written atomically by the grader's own process and signed with an
HMAC whose key no sandboxed process can read (it lives outside every sandbox, in a file readable only by the
grader's user, and its path leaves the grader's environment before any student process starts).

The signature covers the canonical JSON of everything else in the file, so a results file written or edited by anyone
without the key fails verification, and so does a copy of another run's file (the run's nonce is inside).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

from grader.sandbox.policy import RESULTS_KEY_FILE_VARIABLE

SIGNATURE_FIELD = "signature"
NONCE_FIELD = "nonce"


def new_key(path: Path) -> Path:
    """A fresh random key in a file only this user can read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(32))
    return path


def take_key() -> bytes | None:
    """The key named by GRADER_RESULTS_KEY_FILE, read once; the variable leaves the environment."""
    path = os.environ.pop(RESULTS_KEY_FILE_VARIABLE, "")
    return Path(path).read_text().strip().encode() if path.strip() else None


def canonical(data: dict) -> bytes:
    unsigned = {k: v for k, v in data.items() if k != SIGNATURE_FIELD}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode()


def sign(data: dict, key: bytes, nonce: str) -> dict:
    data = {**data, NONCE_FIELD: nonce}
    return {**data, SIGNATURE_FIELD: hmac.new(key, canonical(data), hashlib.sha256).hexdigest()}


def verify(data: dict, key: bytes, nonce: str) -> str | None:
    """None if `data` carries a valid signature for this run's nonce, else why not."""
    signature = data.get(SIGNATURE_FIELD)
    if not isinstance(signature, str):
        return "the results file carries no signature"
    if data.get(NONCE_FIELD) != nonce:
        return "the results file belongs to another grading run"
    if not hmac.compare_digest(signature, hmac.new(key, canonical(data), hashlib.sha256).hexdigest()):
        return "the results file's signature does not match its contents"
    return None


def write_atomically(path: Path, text: str) -> None:
    """Whole or absent: written beside its place, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
    temporary.write_text(text)
    temporary.replace(path)
