"""`python -m assignment new-problem <family>.<name>` and `remove-problem`: see assignment/new_problem.py."""

from assignment.new_problem import main

if __name__ == "__main__":  # importing the package's modules (as the release's checks do) runs nothing
    main()
