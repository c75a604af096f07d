"""A tensor-parallel worker process (ranks 1..N-1): `python -m pdserve.executor.worker SPEC`.

It joins the driver's TP group, builds its shard of the model, maps the node's shared KV cache
and step buffer, then runs one step per StepPlan read from its stdin until Shutdown or end of
file. It dies with its driver: PR_SET_PDEATHSIG (set before exec) kills it when the driver
goes, the pipe's end of file ends it between steps, and a collective whose peer is gone fails.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import NoReturn

import msgspec

from pdserve.executor.messages import LoadLoRA, MapStates, ReportWaits, Shutdown, WorkerSpec, read_message

log = logging.getLogger("pdserve.executor.worker")


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle; it ends us
    spec = msgspec.json.decode(argv[1].encode(), type=WorkerSpec)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{spec.rank} %(levelname)s %(message)s")
    # Deferred on purpose: torch and the model code load here, after SIGINT is set aside above
    # (loading takes seconds, and a Ctrl-C meanwhile is the driver's to handle).
    from pdserve.executor.worker_shard import Shard
    shard = Shard(spec)
    log.info("rank %d of %d ready", spec.rank, spec.world_size)
    waited = 0.0  # seconds blocked on the pipe, waiting for the next step
    while True:
        started = time.perf_counter()
        msg = read_message(sys.stdin.fileno())
        waited += time.perf_counter() - started
        if msg is None or isinstance(msg, Shutdown):
            return 0
        if isinstance(msg, ReportWaits):
            shard.report_waits(waited)
        elif isinstance(msg, LoadLoRA):
            shard.load_lora(msg)
        elif isinstance(msg, MapStates):
            shard.map_states(msg)
        else:
            shard.step(msg)


def exit_now(code: int) -> NoReturn:
    """End the process without the interpreter's teardown. With torch and a model shard loaded,
    collecting every module's objects at exit took 2-5 s on 2 cores, and the driver (a node
    that was told to stop) waited that long for us. Nothing is left to release by then: the
    shared memory, the group's sockets and the pipe are the kernel's to close."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        exit_now(main(sys.argv))
    except Exception:  # a lost peer fails a collective: say so, exit non-zero (the driver sees it)
        log.exception("tensor-parallel worker failed")
        os._exit(1)
