"""One error type for bad input: the CLI prints its message as one line and exits 2."""

from __future__ import annotations

import errno


class UserError(Exception):
    """Bad input the user can fix. The message names the thing and the fix, in one line."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message.replace("\n", " ").strip())


class RunFailure(UserError):
    """A failure at run time (disk full, an I/O error, a server gone): one line, exit 1, after
    cleanup."""

    exit_code = 1


# OSErrors that mean the machine failed (exit 1, free space or check the disk and re-run); every
# other OSError means a path the user gave is wrong: missing, read-only, not permitted (exit 2, fix
# the path).
RUNTIME_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG, errno.EMFILE,
                            errno.ENFILE, errno.ENOMEM, errno.ESTALE})


def os_error(exc: OSError, where: object, fix: str) -> UserError:
    """One line naming ``where`` (the path the user knows; else the errno's own file name) for an
    OSError: RunFailure for a machine failure, else UserError with ``fix``."""
    name = where or exc.filename
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return RunFailure(f"{name}: no space left on device; free space, then {fix}")
    if exc.errno in RUNTIME_ERRNOS:
        return RunFailure(f"{name}: {exc.strerror or exc} (a run-time failure); check the disk, "
                          f"then {fix}")
    return UserError(f"{name}: {exc.strerror or exc}; {fix}")
