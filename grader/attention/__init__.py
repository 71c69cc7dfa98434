"""Grading the attention family: linear-time attention and a hybrid stack."""
