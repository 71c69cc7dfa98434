"""The grader: a pytest suite (`pytest grader`) that grades an implementation package against a reference."""
