"""Hostile: never returns."""


def softmax(x):
    while True:
        pass
