"""Multi-turn chat over a P/D cluster, turn by turn: what each turn's handover moves and computes.

Each of --users conversations sends --rounds turns; a turn is the whole history (earlier
questions and the exact answer tokens) plus a new --question-len-token question, and all users
send turn k before any sends turn k+1. After each turn the nodes' counters (/health, as every
pdserve version reports them) give, summed over the turn's requests:
  computed     prompt tokens the prefill nodes computed (found in no cache)
  loaded       prompt tokens nodes loaded from the KV store instead of computing them
  put          KV bytes the prefill nodes put in the store (their handovers)
  pulled       KV bytes the decode nodes took: store fetches, NIXL READs and push mode's WRITEs
               that landed in them (the handovers)
  lent         KV bytes the prefill nodes READ from a decode node's blocks instead of computing
               them (--handover push over NIXL: the last answer, which only the decode node holds)
  written      KV bytes the decode nodes wrote back to the store (prompts they computed, answers)
  moved        everything that crossed a node's edge: put + pulled + written + lent + loaded's bytes
  shares       pulled and moved / (the turn's prompt tokens x KV bytes per token), beside the
               share of the prompt's tokens new since the last turn (the question and answer)
Greedy answers are kept in --output-json; --same-as OTHER.json checks they are token for token
another run's (another version, the other transport). Run it from another checkout (its path
first on PYTHONPATH, its directory the working one) to measure that version beside this one:

    python -m benchmarks.serving.bench_multiround --transfer store --output-json new.json
    (cd /tmp/base && PYTHONPATH=/tmp/base python /work/main/benchmarks/serving/bench_multiround.py \\
        --transfer store --output-json base.json --same-as /work/main/new.json)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

from benchmarks.support.cluster import local_cluster
from pdserve.loadgen.bench import BenchConfig, send_request

COUNTERS = ("computed", "loaded", "put", "pulled", "written", "lent")


def node_counters(url: str, block_size: int) -> tuple[dict[str, int], int]:
    """COUNTERS summed over the nodes (as each pdserve version reports them in /health), and the
    KV bytes of one token."""
    nodes = httpx.get(f"{url}/health", timeout=10).json()["nodes"]
    per_token = max(int(n.get("kv_bytes_per_token", 0)) for n in nodes)
    out = dict.fromkeys(COUNTERS, 0)
    for node in nodes:
        get = lambda key: int(node.get(key, 0))  # noqa: E731
        out["loaded"] += get("cached_tokens_store")
        if node["role"] == "prefill":
            out["computed"] += get("computed_tokens")
            out["put"] += get("transfer_bytes_store")
            out["lent"] += get("transfer_bytes_nixl")  # (a prefill node READs only what it borrows)
        else:
            written = get("writeback_blocks") * block_size * per_token
            out["written"] += written
            out["pulled"] += (get("transfer_bytes_store") + get("transfer_bytes_nixl")  # (write-backs apart)
                              + get("transfer_bytes_nixl_written"))
    return out, per_token


async def run_turns(url: str, args) -> tuple[list[dict], list[list[list[int]]]]:
    rng = random.Random(args.seed)
    cfg = BenchConfig(base_url=url, model=args.model, output_len=args.answer_len, temperature=0.0)
    histories = [[rng.randrange(100, args.vocab) for _ in range(args.first_len)] for _ in range(args.users)]
    answers: list[list[list[int]]] = [[] for _ in range(args.users)]
    rows = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for turn in range(args.rounds):
            prompts = histories if turn == 0 else [
                h + [rng.randrange(100, args.vocab) for _ in range(args.question_len)] for h in histories]
            before, per_token = node_counters(url, args.block_size)
            results = await asyncio.gather(*(send_request(client, cfg, p) for p in prompts))
            await asyncio.sleep(0.6)  # the nodes' next pongs (every 0.2 s) carry the turn's counters
            after, _ = node_counters(url, args.block_size)
            if any(not r.success for r in results):
                raise RuntimeError(f"turn {turn}: {[r.error for r in results if not r.success]}")
            diff = {k: after[k] - before[k] for k in COUNTERS}
            prompt_tokens = sum(len(p) for p in prompts)
            new = sum(len(p) - (len(h) if turn else 0) for p, h in zip(prompts, histories))
            new += sum(len(a[-1]) - 1 for a in answers) if turn else 0  # the answers the prefill node lacks
            moved = diff["put"] + diff["pulled"] + diff["written"] + diff["lent"] + diff["loaded"] * per_token
            whole = prompt_tokens * per_token
            rows.append({"turn": turn + 1, "prompt_tokens": prompt_tokens, "new_share": new / prompt_tokens, **diff,
                         "moved": moved, "pulled_share": diff["pulled"] / whole, "moved_share": moved / whole,
                         "ttft_ms": statistics.mean(r.ttft_s * 1e3 for r in results)})
            for i, (p, r) in enumerate(zip(prompts, results)):
                answers[i].append(r.token_ids)
                histories[i] = p + r.token_ids
    return rows, answers


def one_run(args, rep: int) -> tuple[list[dict], list]:
    flags = ["--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", args.transfer, "--handover", args.handover,
             "--local-prefill-threshold", "0", "--prefill-placement", "threshold", "--kv-cache-memory-gb", "0.5"]
    with local_cluster(*flags, "--model", args.model) as c:
        # A fresh cluster per repeat (its own Redis): no turn finds another repeat's blocks.
        args.seed = args.base_seed + rep
        return asyncio.run(run_turns(c.url, args))


def table(runs: list[list[dict]]) -> str:
    lines = ["| turn | prompt tokens | new share | computed | loaded | put KiB | pulled KiB | written KiB "
             "| lent KiB | pulled share | moved share | TTFT ms |", "|" + " --- |" * 12]
    for rows in zip(*runs):
        m = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        kib = [f"{m.get(k, 0) / 1024:.0f}" for k in ("put", "pulled", "written", "lent")]
        lines.append(f"| {m['turn']:.0f} | {m['prompt_tokens']:.0f} | {m['new_share']:.2f} | {m['computed']:.0f} "
                     f"| {m['loaded']:.0f} | {' | '.join(kib)} | {m['pulled_share']:.2f} | {m['moved_share']:.2f} "
                     f"| {m['ttft_ms']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--transfer", choices=("store", "nixl"), default="store")
    p.add_argument("--handover", choices=("pull", "push"), default="pull", help="pdserve up's --handover")
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--vocab", type=int, default=250, help="prompt token ids stay below this")
    p.add_argument("--users", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--first-len", type=int, default=256)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16, help="the cluster's KV block size (pdserve up's default)")
    p.add_argument("--repeats", type=int, default=3, help="fresh clusters; the table shows medians")
    p.add_argument("--base-seed", type=int, default=0)
    p.add_argument("--output-json")
    p.add_argument("--same-as", help="a saved run whose greedy answers these must equal")
    args = p.parse_args()
    runs, answers, t0 = [], None, time.perf_counter()
    for rep in range(args.repeats):
        rows, got = one_run(args, rep)
        runs.append(rows)
        answers = answers or []
        answers.append(got)
    print(table(runs))
    print(f"({args.repeats} runs in {time.perf_counter() - t0:.0f} s)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "answers": answers}, f)
    if args.same_as:
        with open(args.same_as) as f:
            other = json.load(f)["answers"]
        same = other[:len(answers)] == answers[:len(other)]
        print("greedy answers identical to", args.same_as, ":", same)
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
