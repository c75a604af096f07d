"""The driver's model runner with pipeline stages: each step's inputs go to every worker, then
rank 0 runs its share of the first stage, hands the hidden states on to the next stage, and
takes the step's logit rows from the last stage, from which it samples as at PP 1.

Steps go one after the other without waiting: launch() runs the first stage's share of a step
and hands it on, collect() takes its results later. The engine keeps one step in flight per
stage (pdserve.engine.pipelined), each over requests the others do not hold, so while the last
stage computes step k the first computes step k + 1. The receives of a step's results are posted
before its first stage runs, and its hidden-state sends are waited on only once the results are
back: a gloo send completes only once its receive is posted, and the last stage sends step k's
results before it takes k + 1's hidden states. A step may also be split into micro-batches
(micro_batches), each handed on as soon as it is computed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
import torch

from pdserve.engine.prompt_logprobs import record_prompt_logprobs
from pdserve.engine.step_inputs import is_decode_query
from pdserve.executor.executor import TPExecutor, WorkerLost
from pdserve.executor.runner import TPModelRunner
from pdserve.executor.shard_step import make_plan, result_rows
from pdserve.executor.stage_link import StageLink, StageRole
from pdserve.executor.step_channel import payload_length

LOSS_NOTICE_S = 2.0  # how long a failed send or receive waits for the watcher to name the lost rank


@dataclass
class _MicroBatch:
    inputs: object
    spans: list
    plan: object


@dataclass
class LaunchedStep:
    """A step whose hidden states went on to the next stage: its results are still to come."""
    batches: list[_MicroBatch]
    posted: list        # the results' receives (PostedResult), one per micro-batch
    sends: list         # the hidden states' sends (PendingSend), done once the results are back
    all_logits: bool


class PipelineModelRunner(TPModelRunner):
    def __init__(self, model, executor: TPExecutor, block_size: int, ops, device: torch.device, dtype: torch.dtype,
                 lora_batch=None):
        super().__init__(model, executor, block_size, ops, device, lora_batch=lora_batch)
        role = StageRole(0, executor.tp_size, executor.pp_size)
        self.link = StageLink(executor.node_group.group, role, model.spec.hidden_size, dtype)
        self.vocab_size = model.spec.vocab_size
        # Steps in flight at once (the engine's batch queue, pdserve.engine.pipelined): one per
        # stage, so each stage computes one step while the others compute theirs.
        self.steps_in_flight = executor.pp_size
        self.micro_batches = 1  # per step (a step split in turn; 1: whole)
        # The shared step buffer in one region per step that may be in flight, plus one for a
        # step run at once (embeddings, prompt logits) while others are in flight: a region is
        # written again only after its step's results came back, so no stage still reads it.
        self._next_region = 0
        self.in_flight = self.peak_in_flight = 0  # steps launched and not collected (and the most at once)

    @torch.inference_mode()
    def execute(self, items, all_logits: bool = False, pending=None) -> tuple[torch.Tensor, list]:
        if pending is not None:
            raise RuntimeError("async scheduling is off at pipeline_parallel_size > 1")
        return self.collect(self.launch(items, all_logits))

    @torch.inference_mode()
    def launch(self, items, all_logits: bool = False) -> LaunchedStep:
        """Runs the first stage's share of a step and hands it on; collect() gives its logits."""
        # decode-shaped queries (one token, or one plus drafts) first, as ModelRunner orders them
        items = sorted(items, key=lambda it: (not is_decode_query(*it), self._lora_slot(it[0])))
        parts = [items] if all_logits else split_micro_batches(items, self.micro_batches)
        batches = [self._micro_batch(part, all_logits) for part in parts]
        start, end = self._region()
        offsets = _payload_offsets([b.plan for b in batches], start)
        if len(batches) > 1 and offsets[-1] > end:  # the micro-batches do not fit side by side: unsplit
            parts, batches = [items], [self._micro_batch(items, all_logits)]
        try:
            posted = [self.link.post_result(*self._result_shape(b.plan)) for b in batches]
            sends = []
            for part, batch, offset in zip(parts, batches, offsets):
                if self.lora_batch is not None:  # this micro-batch's adapter runs (its plan carries them)
                    self.lora_batch.set_runs([(r.lora_slot, n) for r, n in part])
                hidden = self._run_step(batch.plan, batch.inputs, offset, end=end)
                sends.append(self.link.send_hidden(hidden, wait=False))
        except RuntimeError as exc:  # gloo: a peer's socket closed, or the group timed out
            raise self._lost(exc) from None
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return LaunchedStep(batches, posted, sends, all_logits)

    @torch.inference_mode()
    def collect(self, step: LaunchedStep) -> tuple[torch.Tensor, list]:
        """Waits for a launched step's results: (logit rows, the requests they sample)."""
        try:
            results = [p.wait() for p in step.posted]
            for send in step.sends:
                send.wait()
        except RuntimeError as exc:
            raise self._lost(exc) from None
        self.in_flight -= 1
        logits, to_sample = [], []
        for batch, result in zip(step.batches, results):
            rows, sampled = self._logits(batch, result, step.all_logits)
            logits.append(rows)
            to_sample += sampled
        return (torch.cat(logits) if to_sample or step.all_logits else torch.empty(0)), to_sample

    def _region(self) -> tuple[int, int]:
        """The next region of the shared step buffer: (start, end) in int64 elements."""
        regions = self.steps_in_flight + 1
        size = self.executor.channel.capacity // regions
        index, self._next_region = self._next_region % regions, (self._next_region + 1) % regions
        return index * size, (index + 1) * size

    def _lora_slot(self, req) -> int:
        """LoRA: a step's requests grouped by adapter slot, so each adapter's products run once."""
        return -1 if self.lora_batch is None or req.lora_slot is None else req.lora_slot

    def _micro_batch(self, items, all_logits: bool) -> _MicroBatch:
        return _MicroBatch(*self._step_plan(items, all_logits))

    def _result_shape(self, plan) -> tuple[tuple[int, ...], torch.dtype]:
        if plan.return_hidden:
            return (plan.num_tokens, self.link.hidden_size), self.link.dtype
        return (result_rows(plan), self.vocab_size), torch.float32

    def _logits(self, batch: _MicroBatch, result: torch.Tensor, all_logits: bool) -> tuple[torch.Tensor, list]:
        """As ModelRunner._step_logits, with the last stage's rows in place of an LM head: they
        arrive in the order the plan lists the passes, which is the order they are taken here."""
        rows, inputs = _ReceivedRows(result), batch.inputs
        hidden = result.new_empty(batch.plan.num_tokens, 0)  # stands for the rows the driver lacks
        if batch.spans:
            record_prompt_logprobs(rows.take, hidden, batch.spans)
        if all_logits:
            return rows.take(hidden), inputs.to_sample
        if not inputs.to_sample:
            return result.new_empty(0, self.vocab_size), []
        return rows.take(hidden[inputs.sample_rows]), inputs.to_sample

    def _forward_hidden(self, inputs, num_decodes: int, items=()) -> torch.Tensor:
        """The final hidden states (embeddings): the last stage sends them back instead of logits."""
        plan = make_plan(inputs, num_decodes, [], False, in_shm=False)
        plan = msgspec.structs.replace(plan, sample_rows=[], return_hidden=True)
        start, end = self._region()
        try:
            posted = self.link.post_result(*self._result_shape(plan))
            self.link.send_hidden(self._run_step(plan, inputs, start, end=end))
            return posted.wait()
        except RuntimeError as exc:
            raise self._lost(exc) from None

    def _lost(self, exc: Exception) -> WorkerLost:
        deadline = time.monotonic() + LOSS_NOTICE_S
        while self.executor.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return WorkerLost(self.executor.lost or f"a pipeline stage failed: {exc}")


def split_micro_batches(items: list, count: int) -> list[list]:
    """Up to `count` contiguous runs of items with about equal tokens each (items stay in order,
    one-token queries first, so each run is ordered as a step's rows must be)."""
    count = min(count, len(items))
    if count <= 1:
        return [items]
    total = sum(n for _, n in items)
    parts, current, done = [], [], 0
    for item in items:
        current.append(item)
        done += item[1]
        if len(parts) < count - 1 and done >= total * (len(parts) + 1) / count:
            parts.append(current)
            current = []
    return parts + ([current] if current else [])


def _payload_offsets(plans, start: int) -> list[int]:
    """Where each micro-batch's arrays start in the shared buffer, and (last) where they end."""
    offsets = [start]
    for plan in plans:
        offsets.append(offsets[-1] + payload_length(plan))
    return offsets


class _ReceivedRows:
    """compute_logits's stand-in: each call takes the next rows, one per hidden row asked for."""

    def __init__(self, logits: torch.Tensor):
        self.logits, self.next = logits, 0

    def take(self, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        out = self.logits[self.next:self.next + n]
        self.next += n
        return out
