"""Text from student code, made safe to print and to store: what a student's exception says, what their processes
printed, the names they chose. As it came, such text could act on the terminal that shows it (a carriage return and
ESC [K redraw a failing row of the score table as "passed 16/16") or bury the grade under megabytes.

It is made inert where it enters the grader's messages (grader.sandbox.client, grader.ranks.launcher), and
again where the score table, the failure summary and the results file are written (grader.session.report).
"""

from __future__ import annotations

import re
import unicodedata

# One text from student code as a message quotes it: an exception's message, a traceback, a log's last lines.
STUDENT_TEXT_CHARS = 8_000
# One text as the grader finally prints or stores it (a failure in full, a test's output in the results file): it may
# quote a few student texts.
SHOWN_TEXT_CHARS = 32_000

# Characters that may act instead of being shown: control characters (C0, DEL, C1: ESC, CR, backspace, CSI),
# format characters (bidirectional overrides, zero-width ones), line and paragraph separators, lone surrogates (which
# a UTF-8 terminal cannot even be sent). Newline and tab are kept.
HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
# Printable ASCII, newline and tab are never hidden; any other character is looked up.
LOOKED_UP = re.compile(r"[^\t\n\x20-\x7e]")


def _shown(match: re.Match) -> str:
    character = match.group()
    if unicodedata.category(character) in HIDDEN_CATEGORIES:
        return ascii(character)[1:-1]  # ESC as \x1b, CR as \r, U+202E as \u202e
    return character


def escaped(text: str) -> str:
    """`text` with every character that could act on a terminal written as its escape."""
    return LOOKED_UP.sub(_shown, text)


def inert(text: object, limit: int = STUDENT_TEXT_CHARS) -> str:
    """`text` (str() of anything else: a reply may hold anything where a string belongs) escaped, with at most
    `limit` of its characters: its beginning and its end, where a traceback names the error, and how many were cut
    between them. Text without hidden characters, within the limit, comes back unchanged."""
    text = text if isinstance(text, str) else str(text)
    if len(text) > limit:
        head = limit // 2
        text = f"{text[:head]}\n[... {len(text) - limit:,} characters cut ...]\n{text[len(text) - (limit - head):]}"
    return escaped(text)
