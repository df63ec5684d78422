"""The one exception type users see for their own mistakes."""

from __future__ import annotations

from torch._dynamo.exc import ShortenTraceback

__all__ = ["UsageError", "CompileUsageError"]


class UsageError(ValueError):
    """A user mistake, raised before any collective runs; the message names the fix."""


class CompileUsageError(UsageError, ShortenTraceback):
    """A ``UsageError`` found while compiling.

    Dynamo wraps backend exceptions in ``BackendCompilerFailed`` unless they derive from its
    ``ShortenTraceback``; deriving from it lets the user catch the plain ``ValueError``.
    """

    def __init__(self, message: str) -> None:
        ValueError.__init__(self, message)
        self.first_useful_frame = None  # read by ShortenTraceback.remove_dynamo_frames
