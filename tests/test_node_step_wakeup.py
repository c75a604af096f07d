"""The node loop runs each engine step on a worker thread and wakes as soon as the step ends.
A wake-up sent from inside the step, before its future was done, let the loop see a not-yet-done
step and sleep out its 1 s poll: on a loaded machine most decode steps then took a second."""
from __future__ import annotations

import os
import time

from pdserve.assembly.build import build_engine
from pdserve.engine.config import EngineConfig
from pdserve.node.runtime import NodeRuntime


def test_the_loop_wakes_when_the_step_is_done_not_before(monkeypatch):
    engine = build_engine(EngineConfig(model="builtin:tiny", num_kv_blocks=16))
    runtime = NodeRuntime(engine, "tcp://127.0.0.1:0", "decode-0")
    real_write = os.write

    def slow_after_wakeup(fd: int, data: bytes) -> int:
        # A descheduled worker: the wake-up is out, whatever the worker does next comes late.
        n = real_write(fd, data)
        time.sleep(0.01)
        return n

    monkeypatch.setattr(os, "write", slow_after_wakeup)
    try:
        runtime.engine.step = lambda: []  # a step that ends at once: only the wake-up is timed
        start = time.perf_counter()
        for _ in range(20):
            assert runtime._step_answering_pings() == []
        elapsed = time.perf_counter() - start
    finally:
        monkeypatch.undo()
        runtime.close()
    assert elapsed < 5.0, f"20 instant steps took {elapsed:.1f} s: the loop slept out its 1 s poll"
