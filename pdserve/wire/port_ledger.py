"""The ports free_port handed out on this machine lately, shared by every process of this user.

free_port checks that a port is free now, but its server binds it only after its imports (seconds
to a minute). Two launchers drawing in that gap (two `pdserve up` started together, the test
suite's clusters side by side) could both find a port free and hand it to two nodes: one node
then fails to bind, and worse, a router meant for the other cluster pings the node that did
bind and routes to it (seen in CI: a PP 2 node's pongs answered by another cluster's PP 1 node).
The ledger is one small file under the temp directory, locked while read and rewritten; a claim
expires after HOLD_S, long after any server has bound its port."""
from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time

log = logging.getLogger(__name__)

LEDGER_ENV = "PDSERVE_PORT_LEDGER"  # the ledger's path, where not the default (tests)
HOLD_S = 600.0  # a node's imports and weights under a loaded machine take well under this


def ledger_path() -> str:
    return os.environ.get(LEDGER_ENV) or os.path.join(tempfile.gettempdir(), f"pdserve-ports-{os.getuid()}")


def _live_claims(text: str, now: float) -> dict[str, float]:
    """'host port expiry' lines -> {'host port': expiry}, without the expired ones."""
    claims = {}
    for line in text.splitlines():
        try:
            host, port, expiry = line.split()
            if float(expiry) > now:
                claims[f"{host} {port}"] = float(expiry)
        except ValueError:
            continue  # a torn or foreign line is dropped at the next rewrite
    return claims


def claim(host: str, port: int) -> bool:
    """Record (host, port) as handed out; False when another process claimed it within HOLD_S.
    True (unrecorded) where the ledger cannot be written: the in-process check still holds."""
    try:
        fd = os.open(ledger_path(), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        log.debug("port ledger unavailable (%s): ports are checked in this process only", exc)
        return True
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released as the file closes
        now = time.time()
        claims = _live_claims(f.read(), now)
        if f"{host} {port}" in claims:
            return False
        claims[f"{host} {port}"] = now + HOLD_S
        f.seek(0)
        f.truncate()
        f.write("".join(f"{key} {expiry:.0f}\n" for key, expiry in claims.items()))
    return True
