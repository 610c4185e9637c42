"""One exception type for every error a user can act on.

Library code raises `DriftlabError(what_went_wrong, hint=what_to_do)`; the CLI prints both
lines without a traceback. Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class DriftlabError(Exception):
    """An error caused by input or environment, with an actionable hint."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\nHint: {self.hint}"
