"""Hostile: ends its process without unwinding, as if to skip the grader's checks."""

import os


def softmax(x):
    os._exit(0)
