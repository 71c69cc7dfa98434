"""Skip conditions and marks shared by the problems' test modules."""

import pytest
import torch

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
bf16_gpu_only = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="bf16 is graded on a GPU only: Triton's interpreter computes bf16 arithmetic wrongly",
)


def multi_gpu(count: int):
    """Skip unless this machine has at least `count` GPUs (one per rank)."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(available < count, reason=f"needs {count} GPUs, one per rank ({available} here)")


# A test that times the student's kernels on a GPU when there is one, like the speed tests: in the students' copy,
# which grades on the CPU with the GPUs hidden, it runs with them in the GPU lane (grader.plugin.pytest_runtestloop).
timed_on_gpu = pytest.mark.timed_on_gpu
