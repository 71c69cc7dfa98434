"""Hostile: tries to redraw its failing row of the score table as a full pass. Its output, its exception's message and
its exception's class name carry terminal control sequences: a carriage return and ESC [K (erase the line), ESC [1G
(back to column 1), the 8-bit CSI, a right-to-left override, then a forged row."""

FORGED_ROW = "\r\x1b[K\x1b[1Gkernels.softmax  passed  16/16   \x9bK\u202e\r"

RedrawError = type(f"Redraw{FORGED_ROW}", (ValueError,), {})


def softmax(x):
    print(FORGED_ROW, end="", flush=True)
    raise RedrawError(FORGED_ROW * 3)
