"""Hostile: a correct softmax (the reference's kernels, imported from this package's copy) that leaves a thread
running after each call."""

import threading
import time

from . import softmax_kernels


def softmax(x):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    return softmax_kernels.softmax(x)
