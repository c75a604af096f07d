"""Speculative decoding on SmolLM2-135M-Instruct (the default model, its Q4_1 GGUF kept quantized),
offline, against the same engine without it, on an input-grounded workload (chat template,
greedy, 256-token answers): "copy this passage with one word changed" (the default), or "fix the
bug in this code" with the code in the prompt (--workload code). Both sides run the compiled
decode step (pdserve/kernels/native_decode.c) where the machine has it: the engine without
speculation for its one-token steps, the engines with it for their verify steps (k + 1 rows a
request); the last column counts the steps that took it. Runs alternate between the engines so a
change in the machine's load hits each alike; medians of --repeats runs. Per concurrency
(requests decoded together): output tokens/s, TPOT p50 (per request: (last token - first token)
/ (tokens - 1)), and the acceptance rate; the last two columns count output tokens per CPU second of
the process (with one thread, what the run takes alone on a core: a loaded machine, or one that
stops the benchmark a while, inflates wall time but hardly this). The suffix rows are suffix
decoding (each run starts with an empty global tree; --suffix-k adds one with another k);
--workload agent runs multi-turn tool-calling conversations (spec_agent_workload.py), each
turn's prompt holding the earlier answers. Each engine's greedy outputs are checked equal to
speculation off's. The draft-model row is SmolLM2 drafting for itself:
acceptance 1.0, the method's ceiling here, which shows what verification costs. --threads 1 is
what the decode node of a 1P1D cluster gets on a 2-core machine (`pdserve up` shares the cores
out). Run:

    .venv/bin/python -m benchmarks.engine.bench_spec_decode --repeats 5 --no-draft [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks.engine.spec_agent_workload import run_agent

# ~300 tokens: SmolLM2 copies it faithfully past 256 tokens (a 150-token passage ends the answer
# early, and it loses its way in most longer ones it was tried on).
PASSAGE = (
    "A good vegetable garden begins with the soil. Before planting anything, the gardener turns the earth, "
    "removes the stones and the roots of weeds, and mixes in compost made from leaves and kitchen scraps. In "
    "spring the first seeds go in: peas, lettuce and radishes, which like the cool weather. Tomatoes, beans "
    "and courgettes wait until the nights are warm. Every plant needs water, but not too much, and the best "
    "time to water is early in the morning, before the sun is high. Through the summer the gardener pulls "
    "weeds, ties the tall plants to sticks and watches for snails. By the end of the season the shelves of "
    "the kitchen are full of jars, and the garden is ready to rest under a blanket of straw until next year. "
    "Through the winter the gardener plans the next season at the kitchen table, with a notebook, a pencil "
    "and a pile of seed catalogues. Each bed moves one step along, so that the beans grow where the potatoes "
    "grew and the cabbages follow the beans, which keeps the soil healthy and the pests confused. Seeds saved "
    "from the best plants of the summer are sorted into paper packets and labelled with their names and the "
    "date. On the first mild day of the new year the gardener walks the paths again, pulls back the straw and "
    "pushes a fork into the dark earth, which is soft and full of worms. The birds follow close behind, "
    "looking for their breakfast, and the whole cycle of the garden begins once more."
)
CHANGES = [("garden", "plot"), ("garden", "yard"), ("soil", "earth"), ("gardener", "grower")]
# "Fix the bug in this code": total_value adds quantity and price where it should multiply them.
# SmolLM2 answers with the file again (over 256 tokens), rewriting parts of it.
BUGGY_CODE = '''\
def parse_inventory(lines):
    """Parse lines of 'name, quantity, price' into a list of items."""
    items = []
    for number, line in enumerate(lines):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 3:
            raise ValueError(f"line {number}: expected 3 fields, got {len(parts)}")
        name, quantity, price = parts
        items.append({"name": name, "quantity": int(quantity), "price": float(price)})
    return items


def total_value(items):
    """The value of the whole inventory: the sum of quantity times price."""
    total = 0
    for item in items:
        total += item["quantity"] + item["price"]
    return total


def low_stock(items, threshold=5):
    """The names of the items whose quantity is below the threshold, sorted by name."""
    names = []
    for item in items:
        if item["quantity"] < threshold:
            names.append(item["name"])
    return sorted(names)


def report(lines, threshold=5):
    """A short text report of the inventory."""
    items = parse_inventory(lines)
    value = total_value(items)
    low = low_stock(items, threshold)
    text = [f"items: {len(items)}", f"total value: {value:.2f}"]
    if low:
        text.append("low stock: " + ", ".join(low))
    return "\n".join(text)
'''
CODE_ASKS = ["Fix the bug in this code and return the whole corrected code.",
             "There is a bug in total_value. Rewrite the whole file with the bug fixed."]


def workload(tokenizer, concurrency: int, kind: str = "passage") -> list[list[int]]:
    """passage: copy a ~300-token passage with one word changed (each request its own word).
    code: fix the bug in a ~350-token file (SmolLM2 rewrites parts of it: fewer drafts match)."""
    prompts = []
    for i in range(concurrency):
        old, new = CHANGES[i % len(CHANGES)]
        text = f"Copy this text exactly, but replace \"{old}\" with \"{new}\":\n\n{PASSAGE}"
        if kind == "code":
            text = f"{CODE_ASKS[i % 2]}\n\n```python\n{BUGGY_CODE}```"
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        prompts.append(tokenizer(chat, add_special_tokens=False)["input_ids"])
    return prompts


def run(llm, prompts: list[list[int]], new_tokens: int) -> dict:
    """Output tokens/s and per-request TPOTs of the prompts decoded together, and the share of
    the decode steps that ran compiled."""
    from pdserve import SamplingParams
    engine = llm.engine
    native = engine.model.native_decode
    native_before = native.steps if native is not None else 0
    steps = 0
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    first, last, count, ids = {}, {}, {}, {}
    spec = engine.speculator
    before = (spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens) if spec else (0, 0)
    start, cpu = time.perf_counter(), time.process_time()
    names = [f"r{i}-{start}" for i in range(len(prompts))]
    for name, prompt in zip(names, prompts):
        engine.add_request(name, prompt, params)
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            count[out.request_id] = count.get(out.request_id, 0) + len(out.new_token_ids)
            ids.setdefault(out.request_id, []).extend(out.new_token_ids)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tpots = [(last[r] - first[r]) / (count[r] - 1) for r in first]
    drafted = (spec.stats.num_draft_tokens - before[0]) if spec else 0
    accepted = (spec.stats.num_accepted_tokens - before[1]) if spec else 0
    compiled = (native.steps - native_before) if native is not None else 0
    tokens = sum(count.values())
    return {"tok_s": tokens / wall, "cpu_tok_s": tokens / cpu, "tpot_ms": 1e3 * statistics.median(tpots),
            "acceptance": accepted / drafted if drafted else None, "compiled": f"{compiled}/{steps}",
            "tokens": tokens, "wall": wall, "cpu": cpu, "drafted": drafted, "accepted": accepted,
            "ids": [ids[n] for n in names]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--ngram-max", type=int, default=4, help="prompt_lookup_max (min is 2)")
    ap.add_argument("--workload", choices=["passage", "code", "agent"], default="passage",
                    help="agent: multi-turn tool-calling conversations (benchmarks/engine/spec_agent_workload.py)")
    ap.add_argument("--no-suffix", action="store_true", help="skip the suffix-decoding rows")
    ap.add_argument("--suffix-k", type=int, default=None, help="add a suffix engine with this k")
    ap.add_argument("--no-draft", action="store_true", help="skip the draft-model (self-drafting) rows")
    ap.add_argument("--always-k", action="store_true",
                    help="add an n-gram engine without the step-down (every request drafts k each step)")
    ap.add_argument("--disable-by-batch-size", type=int, default=None, help="the n-gram engine's key")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    os.environ.update(OMP_NUM_THREADS=str(args.threads), NUMBA_NUM_THREADS=str(args.threads))
    import torch

    from pdserve import LLM
    from pdserve.models.gguf import DEFAULT_MODEL
    torch.set_num_threads(args.threads)
    common = dict(num_kv_blocks=1024, enable_prefix_caching=False)
    configs = {"off": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
                         "prompt_lookup_max": args.ngram_max,
                         "disable_by_batch_size": args.disable_by_batch_size}}
    if not args.no_suffix:
        configs["suffix"] = {"method": "suffix", "num_speculative_tokens": args.k,
                             "disable_by_batch_size": args.disable_by_batch_size}
        if args.suffix_k:
            configs[f"suffix (k {args.suffix_k})"] = {**configs["suffix"], "num_speculative_tokens": args.suffix_k}
    if args.always_k:  # (its step-down is switched off below, once the engine is built)
        configs["ngram (always k)"] = configs["ngram"]
    if not args.no_draft:
        configs["draft_model (self)"] = {"method": "draft_model", "model": DEFAULT_MODEL,
                                         "num_speculative_tokens": args.k}
    engines = {name: LLM(DEFAULT_MODEL, speculative_config=spec, **common) for name, spec in configs.items()}
    if args.always_k:
        engines["ngram (always k)"].engine.speculator.step_down.fixed_rows = float("inf")
    tokenizer = engines["off"].get_tokenizer()
    for llm in engines.values():
        run(llm, workload(tokenizer, 2, "passage"), 8)  # warm up
    print(f"uptime: {os.popen('uptime').read().strip()}")
    print(json.dumps({"workload": args.workload, "k": args.k, "ngram": [2, args.ngram_max],
                      "new_tokens": args.new_tokens, "threads": args.threads}))
    print("| concurrency | engine | output tok/s | TPOT p50 (ms) | acceptance | speed-up | runs (tok/s) "
          "| compiled steps | tok per CPU s | speed-up (CPU) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        prompts = workload(tokenizer, concurrency, args.workload) if args.workload != "agent" else None
        results: dict[str, list[dict]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, llm in engines.items():
                spec = llm.engine.speculator
                if spec is not None and hasattr(spec.proposer, "clear"):
                    spec.proposer.clear()  # each run starts cold: no earlier run's outputs in the global tree
                if prompts is None:
                    results[name].append(run_agent(llm, tokenizer, concurrency, args.new_tokens, run))
                else:
                    results[name].append(run(llm, prompts, args.new_tokens))
                shown = {k: v for k, v in results[name][-1].items() if k != "ids"}
                print(f"# concurrency {concurrency} {name}: {shown}", flush=True)  # progress
        same = {name: all(r["ids"] == results["off"][0]["ids"] for r in runs) for name, runs in results.items()}
        print(f"# greedy outputs identical to off in every run: {same}", flush=True)
        base = statistics.median(r["tok_s"] for r in results["off"])
        cpu_base = statistics.median(r["cpu_tok_s"] for r in results["off"])
        for name, runs in results.items():
            tok_s = statistics.median(r["tok_s"] for r in runs)
            tpot = statistics.median(r["tpot_ms"] for r in runs)
            acc = [r["acceptance"] for r in runs if r["acceptance"] is not None]
            acc_s = f"{statistics.median(acc):.2f}" if acc else "-"
            each = ", ".join(f"{r['tok_s']:.1f}" for r in runs)
            cpu_tok_s = statistics.median(r["cpu_tok_s"] for r in runs)
            print(f"| {concurrency} | {name} | {tok_s:.1f} | {tpot:.1f} | {acc_s} | {tok_s / base:.2f}x | {each} "
                  f"| {runs[-1]['compiled']} | {cpu_tok_s:.1f} | {cpu_tok_s / cpu_base:.2f}x |", flush=True)
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
