"""Steps in flight across pipeline stages, in the manner of vLLM v1's batch queue: at
pipeline_parallel_size > 1 the engine launches a step and, before its results are back,
schedules and launches the next one over the requests the first does not hold, so the first
stage computes step k + 1 while the last computes step k. Each step is then collected in the
order it was launched, and its tokens sampled, exactly as a step run at once.

A request in a launched step (Request.in_pipeline) is not scheduled again until that step is
collected: its next token is not known yet. A request aborted meanwhile has its blocks freed at
once; that is safe because each stage runs the steps in launch order, so a later step that
reuses a block writes it on every stage after this one did. Its row is dropped at collection.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.engine.scheduler import ScheduledBatch
from pdserve.protocol.outputs import StepOutput


@dataclass
class LaunchedBatch:
    batch: ScheduledBatch
    step: object       # the runner's LaunchedStep
    launched_at: float


def pipelined_step(engine) -> list[StepOutput]:
    """One engine call: launch a step if one more may be in flight and there is work for it;
    collect the oldest step once as many are in flight as may be, or when nothing new ran."""
    # (the scheduler's count, which step() dispatches on; the runner sizes its buffer regions for it)
    queue, depth = engine.launched, engine.scheduler.steps_in_flight
    launched = False
    if len(queue) < depth:
        batch = engine.scheduler.schedule()
        # (tokens still computing count: the node keeps stepping while a step is in flight)
        engine.last_step_tokens = batch.num_tokens + sum(b.batch.num_tokens for b in queue)
        if batch.items:
            for req, _ in batch.items:
                req.in_pipeline = True
            queue.append(LaunchedBatch(batch, engine.runner.launch(batch.items), time.perf_counter()))
            launched = True
    if not queue or (launched and len(queue) < depth):
        return []
    return collect_oldest(engine)


def collect_oldest(engine) -> list[StepOutput]:
    """The oldest launched step's results: its requests free to be scheduled, its tokens drawn."""
    oldest = engine.launched.popleft()
    logits, to_sample = engine.runner.collect(oldest.step)
    for req, _ in oldest.batch.items:
        req.in_pipeline = False
    # Its cost per token: from the later of its launch and the step collected before it, since
    # the steps in flight overlap (each stage's time is what one more step costs).
    started = max(oldest.launched_at, engine.last_collected_at)
    engine.last_collected_at = time.perf_counter()
    return engine.finish_batch(oldest.batch, logits, to_sample, started)

