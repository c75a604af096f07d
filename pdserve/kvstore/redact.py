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


# Store URLs whose Redis the embeddings can use: the scheme the client takes, by the store's.
_REDIS_SCHEMES = {"redis": "redis", "rediss": "rediss", "direct+redis": "redis", "direct+rediss": "rediss",
                  "redis-cluster": "redis-cluster"}


def embedding_store_url(store_url: str | None) -> str | None:
    """The Redis URL a node's --store gives embeddings (None: a store with no Redis)."""
    if not store_url or "://" not in store_url:
        return None
    scheme, rest = store_url.split("://", 1)
    mapped = _REDIS_SCHEMES.get(scheme.lower())
    return f"{mapped}://{rest.split('?', 1)[0]}" if mapped and rest else None
