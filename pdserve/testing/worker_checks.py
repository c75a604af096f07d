"""Checks shared by the tensor- and pipeline-parallel tests: a worker process lost (SIGKILL) fails
the driver's next step and takes the others with it, and workers never outlive their driver."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil  # test dependency

from pdserve import SamplingParams
from pdserve.executor.executor import WorkerLost


def assert_lost_worker_fails_the_next_step(llm) -> None:
    """SIGKILL rank 1: a step soon raises WorkerLost naming it, and no worker is left running."""
    worker = llm.engine.executor.workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    try:
        for _ in range(50):  # the watcher thread notices within a moment
            llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), use_tqdm=False)
    except WorkerLost as exc:
        assert "rank 1" in str(exc), exc
    else:
        raise AssertionError("steps went on after a worker was killed")
    assert all(w.poll() is not None for w in llm.engine.executor.workers)


def assert_workers_die_with_their_driver(model: str, **llm_args) -> None:
    """SIGKILL the driver process (no cleanup runs): its worker goes too."""
    script = textwrap.dedent(f"""
        from pdserve import LLM
        llm = LLM({model!r}, num_kv_blocks=16, **{llm_args!r})
        print("ready", flush=True)
        import time; time.sleep(600)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "ready"
        workers = psutil.Process(driver.pid).children()
        assert len(workers) == 1
        driver.kill()
        driver.wait(timeout=10)
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers outlived their driver: {alive}"
    finally:
        if driver.poll() is None:
            driver.kill()
