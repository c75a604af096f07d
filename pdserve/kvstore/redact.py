"""redact_url: a store URL in the form that may appear in logs and errors.

Imports nothing heavy: the launcher uses it without loading torch, and every store uses it.
"""
from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redact_url(url: str) -> str:
    """url with its password replaced by "***": the form that may appear in logs and errors."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL we can parse (e.g. a bad port): hide everything before "@"
        return url if "@" not in url else url.split("://", 1)[0] + "://***@" + url.rpartition("@")[2]
    if password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
