"""The instructor's releases: the students' copy without the reference (students_copy) and a Gradescope autograder
(gradescope). Neither is part of the students' copy."""
