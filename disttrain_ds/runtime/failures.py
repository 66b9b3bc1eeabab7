"""Which failures are a rank's own and which may be a peer's death seen from here: the latter
give the heartbeats time to name the rank that really failed (``runtime/health.py``)."""

from __future__ import annotations

import errno
import re

from disttrain_ds.errors import ConfigError

LOCAL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT,
                          errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.EFBIG, errno.ENAMETOOLONG})
"""File-system errors that are this rank's own, never the sign of a dead peer."""
COMM_ERRNOS = frozenset({errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT,
                         errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENOTCONN, errno.ESHUTDOWN})
_COMM_TEXT = re.compile(
    r"connection (reset|closed|refused|aborted)|broken pipe|socket|timed out|timeout|\bpeer\b|gloo|nccl"
    r"|process ?group|\bstore\b|rendezvous|unexpected end|remote process exited|transport", re.IGNORECASE)
_DIST_ERRORS = frozenset({"DistError", "DistNetworkError", "DistBackendError", "DistStoreError"})


def waits_for_peer(exc: BaseException) -> bool:
    """Whether ``exc`` may be a neighbour's death seen from here (a broken or timed-out connection),
    so the heartbeats should get time to name the culprit; False for errors that are this rank's own."""
    for e in (exc, exc.__cause__):
        if e is None or isinstance(e, (ConfigError, ValueError, KeyError, TypeError, AssertionError)):
            continue
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if isinstance(e, OSError) and e.errno is not None:
            if e.errno in COMM_ERRNOS:
                return True
            if e.errno in LOCAL_ERRNOS or e.filename is not None:
                continue
        if type(e).__name__ in _DIST_ERRORS:
            return True
        if isinstance(e, OSError) and e.errno is None and not e.args[1:]:
            return True  # a bare OSError (e.g. files another rank should have written): ambiguous, so wait
        if isinstance(e, RuntimeError) and not _is_ours(e) and _COMM_TEXT.search(str(e)):
            return True
    return False


def _is_ours(exc: BaseException) -> bool:
    """Raised by this package's own checks (its messages name what is wrong here)."""
    return type(exc).__module__.startswith("disttrain_ds.") and type(exc).__name__ != "CommTimeoutError"


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``, without gloo's source location and advice."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]).split(". This is typically")[0]
    return f"{type(exc).__name__}: {first}"
