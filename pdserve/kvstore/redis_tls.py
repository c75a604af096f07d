"""tls_options: redis-py's SSL settings for a rediss:// URL, checked up front.

Imports nothing heavy: the node registry's Redis client (which the router loads) uses it as the
Redis stores do, and neither may pull torch in.
"""
from __future__ import annotations

import os
from typing import Any


def tls_options(url: str, ca_file: str | None,
                tls_schemes: str = "rediss:// (or direct+rediss://)") -> dict[str, Any]:
    """redis-py's SSL settings for a rediss:// URL. Verification is spelled out, not left to
    redis-py's defaults: redis-py 5 (our floor) does not check the hostname unless told to.
    tls_schemes: what the error for a CA without TLS tells the user to write instead."""
    if not url.lower().startswith("rediss://"):
        if ca_file is not None:  # a CA with plain TCP means the operator believes they have TLS
            raise ValueError(f"ca_file is a TLS option: use {tls_schemes}")
        return {}
    if ca_file is not None and not os.path.isfile(ca_file):
        # Checked here: at connect time it would read as a dead server on every call instead.
        raise ValueError(f"ca_file {ca_file!r} is not a readable file")
    return {"ssl_cert_reqs": "required", "ssl_check_hostname": True, "ssl_ca_certs": ca_file}
