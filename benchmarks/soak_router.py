"""`pdserve router` as the soak runs it: the same command, with the router's HTTP keep-alive
(pdserve.router.main.KEEP_ALIVE_S, 75 s, no flag) set from PDSERVE_SOAK_KEEP_ALIVE_S, so that
an idle fault a few seconds long outlasts every idle timer the router has: the keep-alive, the
clients' own (httpx: 5 s) and the nodes' NIXL lease.

    python -m benchmarks.soak_router router --model builtin:tiny ...
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys

import pdserve.router.main as router_main
from pdserve.entrypoints.cli import main

if __name__ == "__main__":
    # SIGUSR1 prints every thread's stack, as `python -m pdserve` does: how a hang is seen.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # run_router reads the module global when it starts uvicorn, after this assignment.
    router_main.KEEP_ALIVE_S = float(os.environ.get("PDSERVE_SOAK_KEEP_ALIVE_S", router_main.KEEP_ALIVE_S))
    sys.exit(main())
