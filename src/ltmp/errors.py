"""The one error type for user mistakes that ltmp names: the command line prints it as one line with its fix.

Anything else (a library bug, an unexpected failure) is not an ``LtmpError`` and keeps its traceback.
"""

from __future__ import annotations


class LtmpError(ValueError):
    """A user mistake (bad option, missing file, unsuitable model or data); the message names the fix.

    A ``ValueError`` so that code catching the library's ``ValueError`` keeps working.
    """


class UnsupportedModelError(LtmpError, TypeError):
    """A model ``ltmp.patch`` cannot reduce (architecture, pooling, attention kind); also a ``TypeError``."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """What went wrong, for a one-line message: the first line of ``e`` (at most ``limit`` characters), or its
    type's name when it has no text."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else type(e).__name__
