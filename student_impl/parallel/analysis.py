"""Analysis questions of the parallel training family: numbers you derive or measure, written into ANSWERS below.

The grader reads this file without running it. Write each answer out as a number (an int or a float); an
expression such as 2 * 64 is refused. Leave a question you skip as None: it shows "not answered" and costs only
its own points. This problem's section of the handout states each question in full, with its unit and how close
an answer must be.
"""

ANSWERS = {
    # GiB (2**30 B) of model state per rank: 7e9 parameters, bf16 with Adam as in parallel.accounting, 64 ranks.
    "zero1_gib": None,
    "zero2_gib": None,
    "zero3_gib": None,
    # The least number of micro-batches that takes the bubble of an 8-stage pipeline below 5 %.
    "micro_batches_for_bubble": None,
    # Micro-batches whose activations stage 0 holds at its peak: 4 stages, 12 micro-batches.
    "peak_micro_batches_gpipe": None,
    "peak_micro_batches_1f1b": None,
    # Bytes one rank sends in a ring all-reduce of a 1 GiB bucket over 8 ranks.
    "ring_all_reduce_bytes": None,
    # The bubble you measure: your pipeline_step, GPipe over 4 stages of sleeping layers (handout), 4 and 16
    # micro-batches.
    "measured_bubble_m4": None,
    "measured_bubble_m16": None,
    # The step time in ms you measure: your BucketedDDP over the simulated link (handout), buckets of 0.25,
    # 0.5, 1 and 2 MiB.
    "ddp_step_ms_bucket_0_25mb": None,
    "ddp_step_ms_bucket_0_5mb": None,
    "ddp_step_ms_bucket_1mb": None,
    "ddp_step_ms_bucket_2mb": None,
}
