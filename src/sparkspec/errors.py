"""One error type for bad input: the CLI prints its message as one line and exits 2."""

from __future__ import annotations


class UserError(Exception):
    """Bad input the user can fix. The message names the thing and the fix, in one line."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message.replace("\n", " ").strip())


class RunFailure(UserError):
    """A failure at run time (disk full, an I/O error, a server gone): one line, exit 1, after cleanup."""

    exit_code = 1
