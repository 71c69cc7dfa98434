"""Hostile: dereferences a null pointer when called (a segfault in the worker)."""

import ctypes


def softmax(x):
    return ctypes.string_at(0)
