"""The engine's side of speculation: drafts go into a scheduled batch as extra query tokens of
the decoding requests, the runner scores them with everything else in one forward pass, and
the verified tokens come out as one StepOutput per request.

While the step runs, a drafted request's all_token_ids carries its drafts (the step's inputs
read them from there); take_drafts removes them before anything keys a block on them. The
rejected drafts' KV slots lie past num_computed_tokens, so the next step overwrites them: no
block holds a rejected token once it is committed, and none is leaked (the few blocks drafted
into stay the request's, and are used by the tokens that follow)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request import Request
from pdserve.engine.speculation import SpeculationHost
from pdserve.engine.speculative_config import SpeculativeConfig
from pdserve.protocol.outputs import StepOutput
from pdserve.spec_decode.eligible import may_speculate
from pdserve.spec_decode.step_down import StepDown
from pdserve.spec_decode.verify import accepted_length


@dataclass
class SpecStats:
    """vLLM's counters: drafts proposed, drafts accepted, acceptance per draft position."""
    num_drafts: int = 0  # requests drafted for, summed over steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position += [0] * (num_drafted - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per drafted step: the accepted drafts plus the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def spec_stats(engine) -> dict[str, int]:
    """The node's speculation counters for its Pong (the router's /metrics names them as vLLM does)."""
    spec = getattr(engine, "speculator", None)
    if spec is None:
        return {}
    s = spec.stats
    out = {"spec_num_drafts": s.num_drafts, "spec_num_draft_tokens": s.num_draft_tokens,
           "spec_num_accepted_tokens": s.num_accepted_tokens}
    out.update({f"spec_accepted_pos_{i}": n for i, n in enumerate(s.accepted_per_position)})
    draft_kv = getattr(spec.proposer, "kv", None)
    if draft_kv is not None:  # a draft model's own pool: back to empty once no request runs
        out["spec_draft_blocks_in_use"] = draft_kv.pool.num_blocks - draft_kv.pool.num_free
    return out


def can_speculate(req: Request) -> bool:
    """A request to draft for this step: one that may speculate, decoding its next token."""
    return req.num_tokens - req.num_computed_tokens == 1 and bool(req.output_token_ids) and may_speculate(req)


class Speculator:
    """The engine's Speculation (pdserve.engine.speculation): proposer drafts, the host verifies.
    proposer: propose_batch([(request, k)]) -> drafts, and release(request id) if it keeps any
    state (pdserve.assembly picks it by the config's method)."""

    def __init__(self, config: SpeculativeConfig, host: SpeculationHost, proposer):
        self.config, self.host = config, host
        self.k = config.num_speculative_tokens
        self.proposer = proposer
        self.stats = SpecStats()
        self.step_down = StepDown(self.k, config.disable_by_batch_size)

    def add_drafts(self, batch) -> None:
        """Draft for the batch's decoding requests, within the step's token budget and the free
        KV blocks (a request that gets none decodes one token as usual); how many each gets steps
        down with the batch and the request's acceptance (pdserve.spec_decode.step_down)."""
        host = self.host
        budget = host.config.max_num_batched_tokens - batch.num_tokens
        if self.step_down.step_disabled(sum(1 for _, n in batch.items if n == 1)):
            return
        wanted = []
        for i, (req, n) in enumerate(batch.items):
            if n != 1 or not can_speculate(req):
                continue
            cap = min(req.sampling_params.max_tokens - req.num_output_tokens - 1,
                      host.max_model_len - req.num_tokens - 1)
            k = self.step_down.draft_len(req.request_id, batch.num_tokens, cap)
            if k > 0:
                wanted.append((i, req, k))
        if not wanted:
            return
        drafts = self.proposer.propose_batch([(req, k) for _, req, k in wanted])
        for (i, req, _), draft in zip(wanted, drafts):
            draft = draft[:max(budget, 0)]
            if not draft or not host.kv.allocate(req, 1 + len(draft)):
                continue
            budget -= len(draft)
            req.spec_token_ids = draft
            req.all_token_ids.extend(draft)
            batch.items[i] = (req, 1 + len(draft))

    def take_drafts(self, batch) -> dict[str, list[int]]:
        """After the forward pass: each drafted request's drafts, taken out of its tokens."""
        drafted = {}
        for req, _ in batch.items:
            if req.spec_token_ids:
                drafted[req.request_id] = req.spec_token_ids
                del req.all_token_ids[len(req.all_token_ids) - len(req.spec_token_ids):]
                req.spec_token_ids = []
        return drafted

    def advance(self, req: Request, drafts: list[int], tokens: list[int], logprobs: list) -> StepOutput:
        """Emit the verified tokens of a drafted request (tokens, logprobs: the target's draw at
        its last token and at each draft), stopping where a stop condition ends it."""
        keep = accepted_length(drafts, tokens) + 1
        self.stats.record(len(drafts), keep - 1)
        self.step_down.record(req.request_id, len(drafts), keep - 1)
        host, computed = self.host, req.num_computed_tokens
        outs = []
        for token, logprob in zip(tokens[:keep], logprobs[:keep]):
            outs.append(host.advance(req, token, logprob))
            if outs[-1].finished:
                return merge_outputs(outs)
        req.num_computed_tokens = computed + keep  # the last token and the accepted drafts
        host.kv.commit(req)
        return merge_outputs(outs)

    def release(self, request_id: str) -> None:
        """A request ended: drop whatever the proposer (and the step-down) keeps for it."""
        self.step_down.release(request_id)
        if hasattr(self.proposer, "release"):
            self.proposer.release(request_id)


def merge_outputs(outs: list[StepOutput]) -> StepOutput:
    """One request's several tokens of one step as one output (as a client sees a chunk)."""
    merged = outs[0]
    for out in outs[1:]:
        merged.new_token_ids += out.new_token_ids
        merged.new_text += out.new_text
        if out.new_logprobs is not None:
            merged.new_logprobs = (merged.new_logprobs or []) + out.new_logprobs
        merged.finished, merged.finish_reason, merged.error = out.finished, out.finish_reason, out.error
    return merged
