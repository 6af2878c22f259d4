"""Exception text made fit for a tenant's eyes.

Errors raised below the server (checkpoint readers, the filesystem, the engines) name absolute
paths, and a server path holds the data dir, the model cache and the tenant's id. A tenant
needs the reason, not where the file lives, so every such text that reaches a response goes
through here: an absolute path keeps only its last component (the file the reason is about).
An unexpected failure of a shared batch may be about any request in it, so only its type
reaches the tenants; the server log has the rest.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

# an absolute path: '/' not preceded by a word, a dot, '~', ':' or '/' (so URLs and
# tinker://run/segment/name stay whole), up to whitespace, a quote, a bracket or ':'
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~:/-])/[^\s'\"()\[\]{},:]*")


def _last_component(match: re.Match[str]) -> str:
    name = PurePosixPath(match.group()).name
    return name or "/"


def strip_paths(text: str) -> str:
    return _ABSOLUTE_PATH.sub(_last_component, text)


def exception_text(exc: BaseException) -> str:
    """The reason an error from below the server gives, without server paths. An OSError's
    str() leads with the path it failed on, so only its file name and reason are kept."""
    if isinstance(exc, OSError) and exc.strerror:
        name = PurePosixPath(str(exc.filename)).name if exc.filename is not None else ""
        return f"{name}: {exc.strerror}" if name else exc.strerror
    return strip_paths(str(exc))


def internal_error(doing: str, exc: BaseException) -> str:
    """The message for a failure that is the server's, not the request's."""
    return f"internal error while {doing}: {type(exc).__name__} (the server log has the details)"
