"""Hostile: a correct softmax that replaces the worker's timer, so that every timed call would report a microsecond
and win the speed points whatever the kernel costs."""

import grader.speed.timing

from .softmax_kernels import softmax as _softmax


def _instant(self, function, args):
    return 1e-3, function(*args)


grader.speed.timing.Timer.time_ms = _instant


def softmax(x):
    return _softmax(x)
