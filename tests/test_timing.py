"""The order of what grader.speed.timing puts on the GPU's stream, checked on the CPU with the CUDA calls replaced by
a log: the flush, then the spin that covers the host's way to the first launch, then the start event, the call and
the end event. A cover issued after the start event would be timed as part of every call."""

from __future__ import annotations

import torch

from grader.speed import timing


def test_the_host_cover_runs_between_the_flush_and_the_start_event(monkeypatch):
    stream: list[str] = []

    class Event:
        def __init__(self, enable_timing: bool):
            assert enable_timing

    class Flush:
        def zero_(self):
            stream.append("flush")

    monkeypatch.setattr(timing, "_Event", Event)
    monkeypatch.setattr(timing, "_record", lambda event: stream.append("event"))
    monkeypatch.setattr(timing, "_sleep", lambda cycles: stream.append(f"spin {cycles}"))
    monkeypatch.setattr(timing, "_synchronize", lambda: stream.append("synchronize"))
    monkeypatch.setattr(timing, "_elapsed_time", lambda start, end: 1.5)
    monkeypatch.setattr(timing, "L2_FLUSH_BYTES", 4096)
    timer = timing.Timer(torch.device("cpu"))
    timer.flush = Flush()

    milliseconds, output = timer.time_ms(lambda x: stream.append("call") or x + 1, (torch.ones(2),))

    assert stream == ["flush", f"spin {timing.HOST_COVER_CYCLES}", "event", "call", "event", "synchronize"]
    assert milliseconds == 1.5 and torch.equal(output, torch.full((2,), 2.0))
