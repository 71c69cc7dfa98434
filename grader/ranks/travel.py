"""Evidence that a sharded optimizer's parameters travel from their owners (ZeRO-1 and ZeRO-2).

From the recorder's calls inside `step()` in each rank (in-process evidence): a rank that steps every parameter itself,
with optimizer state it made where a memory probe of the step does not look (in its constructor, say), has right
values and no communication in its step. Counting the bytes its step moves shows it.
"""

from __future__ import annotations

from grader.checks.outcomes import WrongAnswer


def check_parameters_travel(step_calls: list[list[tuple]], sizes: list[int], owners: list, rank: int,
                            context: str) -> None:
    """`step_calls`: per step, the (op, bytes, broadcast source) of each collective the rank issued inside step().
    In every step they move at least the bytes of the parameters the rank does not own, and no broadcast names as its
    source a rank that owns fewer bytes than it sends. `owners`: each parameter's owner (None: no one steps it)."""
    not_owned = sum(size for size, owner in zip(sizes, owners) if owner is not None and owner != rank)
    owned = {}
    for size, owner in zip(sizes, owners):
        owned[owner] = owned.get(owner, 0) + size
    for step, calls in enumerate(step_calls, start=1):
        moved = sum(size for _, size, _ in calls)
        if moved < not_owned:
            raise WrongAnswer(f"{context}: in step {step}, step() moved {moved} bytes through collectives on this rank "
                              f"({', '.join(op for op, _, _ in calls) or 'no call'}); the parameters it does not own "
                              f"take {not_owned}: each updated parameter must come from its owner")
        sent_from = {}
        for op, size, source in calls:
            if op == "broadcast" and source is not None:
                sent_from[source] = sent_from.get(source, 0) + size
        for source, size in sent_from.items():
            if size > owned.get(source, 0):
                raise WrongAnswer(f"{context}: in step {step}, broadcasts from rank {source} carried {size} "
                                  f"bytes; that rank owns {owned.get(source, 0)} bytes of parameters: each parameter "
                                  f"comes from its owner")
