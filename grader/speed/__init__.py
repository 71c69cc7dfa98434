"""Speed points: timing a call on the GPU (timing), the tiers and the alternation of student, reference and
baseline (grading), and the reference/baseline ratios the students' copy grades with (ratios, instructor only)."""
