"""A reference's calls timed under each of several launch configurations: the sweep behind a reference's choice of
block sizes, warps and stages, to run on a new GPU model before choosing its configs. The benchmarks of the
references with such a choice offer it (`python benchmarks/sliding_window.py --backward-configs`, say)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from unittest import mock

import triton


def sweep(module: ModuleType, chooser: str, configs: list[dict], timed_call: Callable[[], float]) -> list[tuple]:
    """(milliseconds, config) of `timed_call()` with `module.<chooser>(...)` returning each config in turn, fastest
    first; a config the GPU cannot run (too much shared memory, say) is reported and left out."""
    timed = []
    for config in configs:
        chosen = lambda *args, config=config: dict(config)  # a fresh dict: the callers pop entries from it
        with mock.patch.object(module, chooser, chosen):
            try:
                milliseconds = timed_call()
            except triton.runtime.errors.OutOfResources as error:
                print(f"{config}: {error}", flush=True)
                continue
        timed.append((milliseconds, config))
        print(f"{config}: {milliseconds:.3f} ms", flush=True)
    return sorted(timed, key=lambda pair: pair[0])


def table(timed: list[tuple], reference_config: dict) -> list[str]:
    """Markdown rows of a sweep: the config's entries, its time, and its time over the reference's config's."""
    keys = list(reference_config)
    current = next(ms for ms, config in timed if config == reference_config)
    header = ["| " + " | ".join(keys) + " | ms | against the reference's config |", "|" + "---|" * (len(keys) + 2)]
    return header + [
        "| " + " | ".join(str(config[key]) for key in keys) + f" | {ms:.2f} | {ms / current:.3f}"
        + (" (the reference)" if config == reference_config else "") + " |"
        for ms, config in timed
    ]
