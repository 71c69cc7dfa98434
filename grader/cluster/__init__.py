"""Grading on a Slurm cluster through submitit: one student's submission (`python -m grader submit`) or a whole
class (`python -m grader grade-all`). Without Slurm, the same commands run through submitit's local executor."""
