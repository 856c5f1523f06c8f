"""What a failed run tells its user: the exception that caused it, in one line, without Ray's wrapping.

An error raised in an actor reaches the driver wrapped: from a method as `RayTaskError(Cause)`,
whose text is Ray's banner (process title, pid, ip, actor id and repr, in colour) and a traceback
with the cause on its last line; from a constructor as `ActorDiedError`, holding that
`RayTaskError`. The cause is what the user wrote or can fix, so it is what they are shown.
"""

from __future__ import annotations

import re

from ray.exceptions import ActorDiedError, RayTaskError

_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def failure_cause(exc: BaseException) -> BaseException:
    """The exception raised inside Ray that `exc` wraps, through any depth of wrapping; `exc` when unwrapped."""
    while True:
        if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException) and exc.cause is not exc:
            exc = exc.cause
        elif isinstance(exc, ActorDiedError) and exc.args and isinstance(exc.args[0], RayTaskError):
            exc = exc.args[0]  # the constructor's failure: Ray builds the error from it and keeps it as its argument
        else:
            return exc


def describe_failure(exc: BaseException) -> str:
    """`Cause: message` of `failure_cause(exc)`, with no terminal colour codes."""
    cause = failure_cause(exc)
    return _TERMINAL_CODES.sub("", f"{type(cause).__name__}: {cause}")
