"""Analysis questions of the Triton kernels family: numbers you measure or derive, written into ANSWERS below.

The grader reads this file without running it. Write each answer out: a number (an int or a float), or, where a
question offers choices, one letter in quotes; an expression such as 2 * 64 is refused. Leave a question you
skip as None: it shows "not answered" and costs only its own points. This problem's section of the handout
states each question in full, with its unit, how close an answer must be and how the grader checks it.
"""

ANSWERS = {
    # Clone's time over your softmax's time, float32 (8192, 4096), timed like the speed tests (0 to about 1).
    "softmax_copy_fraction": 0.99,  # H200: benchmarks/results/references.md
    # The same at float32 (256, 1024), 1 MiB.
    "softmax_copy_fraction_small": 0.78,  # H100: the grader measured 0.776 (its worker, in the sandbox)
    # Why a copy and a softmax of float32 (256, 1024) fall short: "a", "b", "c" or "d" (see the handout).
    "softmax_small_reason": "b",
    # FLOPs per byte of HBM traffic of one 128 x 128 program of a float16 4096^3 matmul, no reuse.
    "matmul_tile_intensity": 63.02,
    # Key blocks loaded by all query-block programs of one (batch, head): causal, T 8192, blocks of 128.
    "flash_key_blocks": 2080,
}
