"""`python -m assignment new-problem <family>.<name>` and `remove-problem`: see assignment/new_problem.py."""

from assignment.new_problem import main

main()
