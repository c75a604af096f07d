"""The driver's model runner with pipeline stages: each step's inputs go to every worker, then
rank 0 runs its share of the first stage, hands the hidden states on to the next stage, and
waits for the step's logit rows from the last stage, from which it samples as at PP 1.

One step is in flight at a time: a stage idles while the others compute (see
docs/pipeline-parallelism.md for what that costs)."""
from __future__ import annotations

import time

import msgspec
import torch

from pdserve.engine.prompt_logprobs import record_prompt_logprobs
from pdserve.executor.executor import TPExecutor, WorkerLost
from pdserve.executor.runner import TPModelRunner
from pdserve.executor.shard_step import make_plan, result_rows
from pdserve.executor.stage_link import StageLink, StageRole

LOSS_NOTICE_S = 2.0  # how long a failed send or receive waits for the watcher to name the lost rank


class PipelineModelRunner(TPModelRunner):
    def __init__(self, model, executor: TPExecutor, block_size: int, ops, device: torch.device, dtype: torch.dtype):
        super().__init__(model, executor, block_size, ops, device)
        role = StageRole(0, executor.tp_size, executor.pp_size)
        self.link = StageLink(executor.node_group.group, role, model.spec.hidden_size, dtype)
        self.vocab_size = model.spec.vocab_size
        self._results = torch.empty(0)

    def _run_step(self, plan, inputs) -> torch.Tensor:
        """Stage 0's share of the step, handed on; returns the final hidden states when the plan
        asks for them (embeddings), else a [tokens, 0] stand-in whose rows index the logit rows
        received (the driver holds no LM head)."""
        hidden = super()._run_step(plan, inputs)
        if plan.return_hidden:
            shape, dtype = (plan.num_tokens, self.link.hidden_size), self.link.dtype
        else:
            shape, dtype = (result_rows(plan), self.vocab_size), torch.float32
        self._results = self._exchange(hidden, shape, dtype)
        return self._results if plan.return_hidden else hidden.new_empty(plan.num_tokens, 0)

    def _exchange(self, hidden: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
        try:
            self.link.send_hidden(hidden)
            return self.link.recv_result(shape, dtype)
        except RuntimeError as exc:  # gloo: a peer's socket closed, or the group timed out
            deadline = time.monotonic() + LOSS_NOTICE_S
            while self.executor.lost is None and time.monotonic() < deadline:
                time.sleep(0.05)
            raise WorkerLost(self.executor.lost or f"a pipeline stage failed: {exc}") from None

    def _forward_hidden(self, inputs, num_decodes: int, items=()) -> torch.Tensor:
        plan = make_plan(inputs, num_decodes, [], False, in_shm=False)
        return self._run_step(msgspec.structs.replace(plan, sample_rows=[], return_hidden=True), inputs)

    def _step_logits(self, hidden: torch.Tensor, inputs, spans, all_logits: bool
                     ) -> tuple[torch.Tensor, list]:
        """As ModelRunner's, with the last stage's rows in place of an LM head: they arrive in
        the order the plan lists the passes, which is the order they are asked for here."""
        rows = _ReceivedRows(self._results)
        if spans:
            record_prompt_logprobs(rows.take, hidden, spans)
        if all_logits:
            return rows.take(hidden), inputs.to_sample
        if not inputs.to_sample:
            return torch.empty(0), []
        return rows.take(hidden[inputs.sample_rows]), inputs.to_sample


class _ReceivedRows:
    """compute_logits's stand-in: each call takes the next rows, one per hidden row asked for."""

    def __init__(self, logits: torch.Tensor):
        self.logits, self.next = logits, 0

    def take(self, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        out = self.logits[self.next:self.next + n]
        self.next += n
        return out
