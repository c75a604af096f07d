"""Where one speculative step's time goes, at one request on the default model (SmolLM2 Q4_1, the
compiled decode step), beside the same engine without speculation; with
--concurrency, the decode throughput of a batch in tokens per CPU second.

Each phase is timed exclusively (a phase inside another is taken out of it), in CPU seconds of
the process (one thread: the time a step takes alone on a core, which a loaded machine does not
inflate the way it inflates wall time), over the decode steps of a --new-tokens answer to the
passage-copy prompt of bench_spec_decode (its first, prefill, step left out). The engines
alternate run by run; medians of --repeats runs. Phases:

- propose: the n-gram lookup (proposer.propose_batch);
- drafts in: the step-down rule, drafts appended to the request's tokens, KV slots allocated;
- forward: the model runner over the step's rows (the verify forward with speculation);
- sample: the target's draw at every row (the verify rows with speculation);
- accept + commit: the accepted prefix, the computed-token count, the KV blocks committed;
- emit: each emitted token's stop checks, text and step output (engine.advance);
- KV rollback: the drafts taken out of the request's tokens (the rejected drafts' KV slots lie
  past the computed tokens and are overwritten by the next step: nothing is copied or freed);
- rest: the step around them (scheduling, the batch, the outputs).

Without speculation the engine overlaps each step's forward pass with the previous step's
bookkeeping (async scheduling; speculation runs without it), so its parts are those of the
overlapped step.

    .venv/bin/python -m benchmarks.engine.spec_step_profile [--repeats 3] [--new-tokens 128]
        [--concurrency 1] [--always-k]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

PHASES = ["propose", "drafts in", "forward", "sample", "accept + commit", "emit", "KV rollback", "rest"]


class Timers:
    """Exclusive CPU time per phase: a wrapped call's time less its wrapped callees'."""

    def __init__(self):
        self.total: dict[str, float] = defaultdict(float)
        self.stack: list[float] = []

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.process_time()
            self.stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                spent, inner = time.process_time() - t0, self.stack.pop()
                self.total[name] += spent - inner
                if self.stack:
                    self.stack[-1] += spent
        return timed


def instrument(llm, timers: Timers) -> None:
    import pdserve.engine.engine as engine_module
    import pdserve.engine.overlap as overlap_module
    eng, spec = llm.engine, llm.engine.speculator
    eng.runner.execute = timers.wrap("forward", eng.runner.execute)
    eng.advance = timers.wrap("emit", eng.advance)
    eng.step = timers.wrap("rest", eng.step)
    if spec is not None:
        spec.proposer.propose_batch = timers.wrap("propose", spec.proposer.propose_batch)
        spec.add_drafts = timers.wrap("drafts in", spec.add_drafts)
        spec.take_drafts = timers.wrap("KV rollback", spec.take_drafts)
        spec.advance = timers.wrap("accept + commit", spec.advance)
    # Without speculation the engine overlaps its steps (async scheduling) and draws greedy
    # tokens in pdserve.engine.overlap; with it, in the engine's verify.
    for module, name in ((engine_module, "sample"), (overlap_module, "greedy_tokens")):
        if not hasattr(module, "_unprofiled_" + name):
            setattr(module, "_unprofiled_" + name, getattr(module, name))
        setattr(module, name, timers.wrap("sample", getattr(module, "_unprofiled_" + name)))


def profile(llm, timers: Timers, prompts: list[list[int]], new_tokens: int) -> dict:
    """The prompts' decode steps: ms of CPU per step by phase, tokens per step, acceptance."""
    from pdserve import SamplingParams
    eng, spec = llm.engine, llm.engine.speculator
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    rids = [f"p{i}-{time.perf_counter()}" for i in range(len(prompts))]
    for rid, prompt in zip(rids, prompts):
        eng.add_request(rid, prompt, params)
    started: set[str] = set()
    while not started.issuperset(rids):  # the prefill steps (prefix hits after the first run)
        started.update(out.request_id for out in eng.step() if out.new_token_ids)
    before = (spec.stats.num_drafts, spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens) if spec else None
    timers.total.clear()
    steps = tokens = 0
    while eng.has_unfinished_requests():
        tokens += sum(len(out.new_token_ids) for out in eng.step())
        steps += 1
    row = {name: 1e3 * timers.total[name] / steps for name in PHASES}
    row.update(step=sum(row[name] for name in PHASES), tokens_per_step=tokens / steps)
    row["tok_per_cpu_s"] = 1e3 * row["tokens_per_step"] / row["step"]
    if spec is not None:
        drafts = spec.stats.num_drafts - before[0]
        drafted, accepted = spec.stats.num_draft_tokens - before[1], spec.stats.num_accepted_tokens - before[2]
        row.update(acceptance=accepted / drafted if drafted else 0.0,
                   mean_accepted_length=1 + accepted / drafts if drafts else 1.0, drafted_steps=drafts / steps)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=1, help="requests decoded together")
    ap.add_argument("--always-k", action="store_true", help="the n-gram engine without the step-down")
    args = ap.parse_args()
    os.environ.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    import torch

    from benchmarks.engine.bench_spec_decode import workload
    from pdserve import LLM
    from pdserve.models.gguf import DEFAULT_MODEL
    torch.set_num_threads(1)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    # Prefix caching: the runs after the first skip the prompts' prefill (which is not profiled).
    common = dict(num_kv_blocks=64 + 48 * args.concurrency)
    engines = {"off": LLM(DEFAULT_MODEL, **common), "ngram": LLM(DEFAULT_MODEL, speculative_config=ngram, **common)}
    if args.always_k:
        engines["ngram"].engine.speculator.step_down.fixed_rows = float("inf")
    prompts = workload(engines["off"].get_tokenizer(), args.concurrency)
    timers = {name: Timers() for name in engines}
    for name, llm in engines.items():
        instrument(llm, timers[name])
        profile(llm, timers[name], prompts, 8)  # warm up
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            runs[name].append(profile(llm, timers[name], prompts, args.new_tokens))
            print(f"# {name}: {runs[name][-1]}", flush=True)
    med = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
    print(f"concurrency {args.concurrency}, k {args.k}, always k: {args.always_k}, new tokens {args.new_tokens}")
    print("| phase | off (ms CPU / step) | ngram (ms CPU / step) |\n|---|---|---|")
    for key in PHASES + ["step", "tokens_per_step", "tok_per_cpu_s"]:
        print(f"| {key} | {med['off'][key]:.2f} | {med['ngram'][key]:.2f} |")
    off_ms, ngram_ms = (med[n]["step"] / med[n]["tokens_per_step"] for n in ("off", "ngram"))
    print(f"| ms CPU per token | {off_ms:.2f} | {ngram_ms:.2f} |")
    g = med["ngram"]
    print(f"\nacceptance {g['acceptance']:.2f}, mean accepted length {g['mean_accepted_length']:.2f}, "
          f"drafted steps {g['drafted_steps']:.2f}, speed-up in CPU time {off_ms / ngram_ms:.2f}x")


if __name__ == "__main__":
    main()
