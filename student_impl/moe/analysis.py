"""Analysis questions of the mixture-of-experts family: numbers you derive, written into ANSWERS below.

The grader reads this file without running it. Write each answer out as a number (an int or a float); an
expression such as 2 * 64 is refused. Leave a question you skip as None: it shows "not answered" and costs only
its own points. This problem's section of the handout states each question in full, with its unit and how close
an answer must be.
"""

ANSWERS = {
    # Slots per expert: 4096 tokens, top-2 of 64 experts, capacity factor 1.25.
    "capacity_slots": None,
    # Assignments dropped there when every first choice is expert 0 and the second choices spread evenly.
    "capacity_dropped": None,
    # The Switch balance loss when all tokens go to experts 0 and 1 of 8 (top-2), each with probability 0.5.
    "balance_loss_two_experts": None,
    # Activated over total parameters of DeepSeek-V3's shapes with multi-head attention (see the handout).
    "activated_fraction": None,
}
