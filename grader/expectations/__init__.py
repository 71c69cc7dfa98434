"""Stored expectations: what the grader takes from the reference, kept so that the students' copy grades without it.

A test asks the reference for values through the `reference` fixture (calls of its functions) and through
`Ranks.run_reference` (launches of the reference on ranks). Recording (`pytest grader --impl reference
--record-expectations DIR`, run by `python -m grader release`) stores, under the test's node id and a digest of the
call's inputs:

- the value returned, as plain tensors, numbers, strings and containers;
- the gradients that flowed back to the call's tensor arguments, under a digest of the gradients that came in (so a
  test may call backward() on what the reference returned, as the MoE and kernel tests do);
- the call's effects on its arguments: gradients accumulated into tensors and module parameters, values changed in
  place (a single-process training step does both);
- the seconds it took, which set the student's time budget as the live reference's time does.

Replaying (`--expectations DIR`, the default in the students' copy) serves those records. The public and ci profiles
draw the same inputs on every run, so a student's test draws exactly the recorded inputs until its first failing
one; that one is reported, unshrunk (hypothesis would shrink through inputs never recorded, each costing a call of
the student's code on a large input to learn nothing). A missing expectation is never a verdict: the example is
rejected, and a test that passes after missing any did not draw what was recorded (another torch or hypothesis
version): it is "not graded", and says so. The draws are checked once per session as well, against a digest of a
canonical draw stored with the records.

The files are `torch.save` archives of plain containers, tensors, numbers and strings, read back with
`weights_only=True`: loading them executes no code, compressed with xz. One file per problem and profile:
`DIR/<profile>/<problem id>.pt.xz`.
"""

from grader.expectations.digests import canonical_draws, digest, versions
from grader.expectations.misses import DrawsDiffer, misses_in_test
from grader.expectations.store import SUFFIX, Store, check_draws, read, record, replay
from grader.expectations.students_copy import (
                                               gpu_lane_environment,
                                               hidden_gpus_present,
                                               hide_gpus_in_students_copy,
                                               in_gpu_lane,
                                               students_copy_folder,
)
from grader.expectations.values import plain_tensors

__all__ = ["DrawsDiffer", "SUFFIX", "Store", "canonical_draws", "check_draws", "digest", "gpu_lane_environment",
           "hidden_gpus_present", "hide_gpus_in_students_copy", "in_gpu_lane", "misses_in_test", "plain_tensors",
           "read", "record", "replay", "students_copy_folder", "versions"]
