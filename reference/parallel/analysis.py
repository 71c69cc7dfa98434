"""Analysis questions of the parallel training family: numbers you derive or measure, written into ANSWERS below.

The grader reads this file without running it. Write each answer out as a number (an int or a float); an
expression such as 2 * 64 is refused. Leave a question you skip as None: it shows "not answered" and costs only
its own points. This problem's section of the handout states each question in full, with its unit and how close
an answer must be.
"""

ANSWERS = {
    # GiB (2**30 B) of model state per rank: 7e9 parameters, bf16 with Adam as in parallel.accounting, 64 ranks.
    "zero1_gib": 27.3,
    "zero2_gib": 14.46,
    "zero3_gib": 1.63,
    # The least number of micro-batches that takes the bubble of an 8-stage pipeline below 5 %.
    "micro_batches_for_bubble": 134,
    # Micro-batches whose activations stage 0 holds at its peak: 4 stages, 12 micro-batches.
    "peak_micro_batches_gpipe": 12,
    "peak_micro_batches_1f1b": 4,
    # Bytes one rank sends in a ring all-reduce of a 1 GiB bucket over 8 ranks.
    "ring_all_reduce_bytes": 1879048192,
    # The bubble you measure: your pipeline_step, GPipe over 4 stages of sleeping layers (handout), 4 and 16
    # micro-batches.
    "measured_bubble_m4": 0.44,
    "measured_bubble_m16": 0.17,
    # The step time in ms you measure: your BucketedDDP over the simulated link (handout), buckets of 0.25,
    # 0.5, 1 and 2 MiB.
    "ddp_step_ms_bucket_0_25mb": 224,
    "ddp_step_ms_bucket_0_5mb": 208,
    "ddp_step_ms_bucket_1mb": 238,
    "ddp_step_ms_bucket_2mb": 299,
}
