"""Store handovers off the prefill node's loop.

The put of a prompt's blocks to the shared store runs on a thread of its own, so a slow or
stalled store (a Redis under SIGSTOP, whose digest ledger waits out its 2 s socket timeout) never
holds the loop that answers the router's pings and steps the other requests. The first token and
the handover go out once the put ends. Until then the request keeps its blocks, an aborted one
too: a block freed and reused while the put reads it would put another prompt's KV under these
keys, for every node to read.
"""
from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future, ThreadPoolExecutor

from pdserve.kvstore.errors import KVStoreError
from pdserve.node.producers import StoreJob, StoreProducer
from pdserve.protocol.outputs import StepOutput
from pdserve.wire.handover import StoreHandover

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StorePut:
    job: StoreJob
    first: StepOutput  # the first token, sent with the handover
    future: Future
    made: float = 0.0  # perf_counter when the first token came out (the put's wait, for the TTFT breakdown)
    aborted: bool = False

    @property
    def request_id(self) -> str:
        return self.job.pending.request.request_id


class StorePuts:
    def __init__(self, producer: StoreProducer):
        self.producer = producer
        self.inflight: dict[str, StorePut] = {}
        # One thread: puts keep their order, and a stalled store holds one thread, not many.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="store-put")

    def start(self, job: StoreJob, first: StepOutput, made: float = 0.0) -> None:
        put = StorePut(job, first, self._pool.submit(self.producer.write, job), made)
        self.inflight[put.request_id] = put

    def abort(self, request_id: str) -> bool:
        """True when the request's put is in flight: its blocks are freed when it ends."""
        put = self.inflight.get(request_id)
        if put is not None:
            put.aborted = True
        return put is not None

    def finished(self) -> list[tuple[StorePut, StoreHandover | None]]:
        """The puts that ended, each with its handover (None: it failed, the decode node recomputes)."""
        out = []
        for rid in [rid for rid, put in self.inflight.items() if put.future.done()]:
            put = self.inflight.pop(rid)
            try:
                handover = put.future.result()
            except (KVStoreError, RuntimeError) as exc:
                log.warning("[%s] handover failed, the decode node will recompute: %s", rid, exc)
                handover = None
            out.append((put, handover))
        return out

    def idle(self) -> bool:
        return not self.inflight

    def close(self) -> None:
        """Wait for the puts in flight (the store closes after them)."""
        self._pool.shutdown(wait=True)
