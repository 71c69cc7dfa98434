"""Analysis questions of the attention family: numbers you measure or derive, written into ANSWERS below.

The grader reads this file without running it. Write each answer out as a number (an int or a float); an
expression such as 2 * 64 is refused. Leave a question you skip as None: it shows "not answered" and costs only
its own points. This problem's section of the handout states each question in full, with its unit, how close an
answer must be and how the grader checks it.
"""

ANSWERS = {
    # Query-key pairs causal attention scores over those a sliding window scores: T 8192, window 1024.
    "window_work_ratio": 4.267,
    # torch's causal flash time over your sliding window's, forward and backward, the speed test's second shape.
    "sliding_window_speedup": 5.02,  # H200: grader/speed/ratios.json, 12.75 / 2.54 ms
    # First T of 512, 1024, ..., 16384 where your chunked linear attention beats causal flash (32768: none).
    "linear_attention_crossover_seq": 2048,  # H200: 2048 timed in-process, 4096 by the grader
    # Fraction of causal attention's query-key pairs that sparse attention scores: T 32768, top-k 2048.
    "dsa_attended_fraction": 0.1211,
    # Multi-head attention's KV cache per token over MLA's: 128 heads of 128, latent 512, RoPE key 64.
    "mla_cache_ratio": 56.89,
}
