"""A node's NIXL side channel (a prefill node's, an encoder node's), answered on a thread of its own.

A decode node handshakes (pullers.fetch_peer_metadata) the first time it READs from a prefill
node or tells it a request's blocks may be freed: a request on this channel, waiting up to 3 s
for the agent's metadata. Answered by the node's loop, it waited whenever the loop was busy. In
push mode the loop WRITEs into that same decode node, and a fresh pair's early WRITE completes
only once the decode node progresses its UCX worker, which it does not while its own loop waits
for this answer: both nodes stood still until the WRITE's 0.5 s deadline (the WRITE failed and
the decode node READ instead), or, with a 5 s deadline, 2-3 s with both silent to the router
(docs/benchmarks/handover.md). The answer does not change once the agent is up, so a thread
sends a copy and never waits on the loop. An encoder node (E/P/D) serves its embeddings' arena the
same way, so a prefill node's first READ of an image never waits for an encoder step.
"""
from __future__ import annotations

import logging
import threading

from pdserve.wire.handover import NixlMetadata, NixlMetadataRequest
from pdserve.wire.transport import NodeSocket

log = logging.getLogger(__name__)
POLL_MS = 100  # how soon close() is noticed
JOIN_S = 5.0  # close() waits this long for the thread (a loaded machine may not run it for a while)


class MetadataServer:
    """Answers NixlMetadataRequest on `side` (which it owns from here on) with `metadata`."""

    def __init__(self, side: NodeSocket, metadata: NixlMetadata):
        self.side, self.metadata = side, metadata
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="nixl-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.side.sock.poll(POLL_MS):
                continue
            while (item := self.side.recv()) is not None:
                identity, msg = item
                if isinstance(msg, NixlMetadataRequest):
                    self.side.send(identity, self.metadata)
                else:
                    log.warning("the NIXL side channel ignores %s", type(msg).__name__)

    def close(self) -> None:
        """Stop the thread, then close the socket: never under the thread, which may be polling it."""
        self._stop.set()
        self._thread.join(timeout=JOIN_S)
        if self._thread.is_alive():
            log.warning("the NIXL side channel's thread did not stop in %.0f s: its socket is left open", JOIN_S)
            return
        self.side.close()
