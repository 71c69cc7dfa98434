"""Skip conditions shared by the problems' test modules."""

import pytest
import torch

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
bf16_gpu_only = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="bf16 is graded on a GPU only: Triton's interpreter computes bf16 arithmetic wrongly",
)
