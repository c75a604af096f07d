"""A real node (engine, zmq ROUTER socket) serving on loopback in a thread of the test process,
for tests that drive one node over real sockets and look inside it as they go."""
from __future__ import annotations

import contextlib
import threading


@contextlib.contextmanager
def serving_in_thread(node):
    """Run node.run_once() in a loop until the block ends, then close the node."""
    stop = threading.Event()

    def loop():  # serve_forever installs signal handlers, which only the main thread may
        while not stop.is_set():
            node.run_once()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield node
    finally:
        stop.set()
        thread.join(10)
        node.close()
