"""pdserve against Hugging Face `transformers serve` on the same model.

    .venv/bin/python -m benchmarks.peers.bench_vs_transformers_serve [--repeats 3] [--concurrency 8] \
        [--tf-mode auto|cb|plain] [--tf-pythonpath DIR] [--output-json out.json]

transformers serve always loads with device_map, which needs `accelerate`; without it in the venv,
`pip install --no-deps --target /tmp/accel accelerate` and pass --tf-pythonpath /tmp/accel.

Workload: /v1/chat/completions, streamed, 48 fixed chat prompts (words drawn with
random.Random(seed)), greedy (temperature 0), max_tokens 64, concurrency 8. Model: the bench Llama
shape (benchmarks/support/bench_model.py CONFIG: hidden 512, 8 layers, 8 heads, 4 KV heads) written by
pdserve's seeded builder with the byte tokenizer and its chat template, so the vocabulary matches the
tokenizer (261 ids, tied embeddings) and every generated id decodes to text. float32 on CPU.

Configs, one server up at a time, alternating over --repeats (t, m, p, t, m, p, ...), each run
preceded by one warm-up request:
  transformers   `transformers serve DIR` (--continuous-batching when it works here, see --tf-mode)
  pdserve-mono   pdserve up --prefill-nodes 0 --decode-nodes 1
  pdserve-pd     pdserve up --prefill-nodes 1 --decode-nodes 1 --kv-transfer nixl
TTFT is the time to the first streamed chunk with non-empty content; output tokens come from the
final usage chunk. Prints medians over repeats, ratios pdserve / transformers, and how many of the
48 generated texts match the transformers text exactly (first repeat), and ignoring U+FFFD.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.support.bench_model import CONFIG
from benchmarks.support.cluster import local_cluster, peer_server, source_info
from pdserve.wire.transport import free_port

PD_FLAGS = {"pdserve-mono": ["--prefill-nodes", "0", "--decode-nodes", "1"],
            "pdserve-pd": ["--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "nixl"]}
NAMES = ("transformers", *PD_FLAGS)
WORDS = ("river stone cloud market engine garden letter window silver orange thunder pocket "
         "harbor lantern meadow violin copper candle forest bridge planet marble whisper tiger "
         "anchor basket canyon dragon feather glacier island jungle kettle ladder mirror needle").split()
COLUMNS = [("req/s", "req_per_s", "{:.2f}"), ("out tok/s", "out_tok_per_s", "{:.1f}"),
           ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"), ("e2e p50 ms", "e2e_p50_ms", "{:.0f}")]


def build_model(root: Path) -> Path:
    from pdserve.models.builtin import write_builtin_model
    dims = {k: v for k, v in CONFIG.items() if k != "vocab_size"}
    write_builtin_model(root, {**dims, "tie_word_embeddings": True, "rope_theta": 10000.0,
                               "rms_norm_eps": 1e-5})
    return root


def chat_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["Continue this list of words: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 48)))
            for _ in range(n)]


# ---------------------------------------------------------------- servers

@contextlib.contextmanager
def tf_server(model: Path, cb: bool, log_path: str, timeout_s: float, extra_path: str | None):
    port = free_port()
    exe = str(Path(sys.executable).with_name("transformers"))
    cmd = [exe, "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
           "--dtype", "float32", "--continuous-batching" if cb else "--no-continuous-batching"]
    env = dict(os.environ)
    if extra_path:  # transformers serve always passes device_map, which needs `accelerate`
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [extra_path, env.get("PYTHONPATH")]))
    with peer_server("transformers serve", cmd, port, log_path, timeout_s, env) as (url, _):
        yield url


@contextlib.contextmanager
def server(name: str, model: Path, args, log_path: str):
    if name == "transformers":
        with tf_server(model, args.tf_mode == "cb", log_path, args.startup_timeout_s, args.tf_pythonpath) as url:
            yield url
    else:
        with local_cluster("--model", str(model), *PD_FLAGS[name], log_path=log_path,
                           startup_timeout_s=args.startup_timeout_s) as c:
            yield c.url


# ---------------------------------------------------------------- client

async def sse_lines(resp: httpx.Response):
    """Lines split on "\n" only: aiter_lines() also splits on U+2028, U+0085, ..., which byte-level
    tokens produce and transformers serve's JSON leaves unescaped."""
    buf = ""
    async for chunk in resp.aiter_text():
        buf += chunk
        *lines, buf = buf.split("\n")
        for line in lines:
            yield line.rstrip("\r")
    if buf:
        yield buf


async def chat(client: httpx.AsyncClient, model_id: str, prompt: str, args, extra: dict) -> dict:
    body = {"model": model_id, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "temperature": 0, "max_tokens": args.max_tokens, "stream_options": {"include_usage": True},
            **extra}
    out = {"ttft_s": None, "tokens": 0, "text": "", "error": None}
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            out["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
            return out
        async for line in sse_lines(resp):
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            try:
                event = json.loads(line[5:])
            except json.JSONDecodeError:  # transformers serve writes its stream errors unescaped
                out["error"] = f"bad SSE line: {line[:300]}"
                continue
            if "error" in event:
                out["error"] = str(event["error"])
            if event.get("usage"):
                out["tokens"] = event["usage"].get("completion_tokens", 0)
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") or ""
                if text and out["ttft_s"] is None:
                    out["ttft_s"] = time.perf_counter() - t0
                out["text"] += text
    out["e2e_s"] = time.perf_counter() - t0
    return out


async def run_load(url: str, model_id: str | None, prompts: list[str], args,
                   extra: dict) -> tuple[list[dict], float]:
    limiter = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout_s) as client:
        # transformers serve's /v1/models scans the hub cache: name its forced model (the dir) instead
        model_id = model_id or (await client.get("/v1/models")).json()["data"][0]["id"]
        warm = await chat(client, model_id, "Hello there, warm up.", args, extra)
        if warm["error"]:
            raise RuntimeError(f"warm-up failed: {warm['error']}")

        async def one(p: str) -> dict:
            async with limiter:
                return await chat(client, model_id, p, args, extra)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return results, time.perf_counter() - t0


def summarize(results: list[dict], wall_s: float) -> dict:
    ok = [r for r in results if not r["error"] and r["ttft_s"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    return {"ok": len(ok), "errors": [r["error"] for r in results if r["error"]][:3], "wall_s": wall_s,
            "req_per_s": len(ok) / wall_s, "out_tok_per_s": tokens / wall_s, "out_tokens": tokens,
            "ttft_p50_ms": statistics.median(r["ttft_s"] for r in ok) * 1e3 if ok else float("nan"),
            "e2e_p50_ms": statistics.median(r["e2e_s"] for r in ok) * 1e3 if ok else float("nan")}


def run_one(name: str, model: Path, prompts: list[str], args, log_path: str) -> tuple[dict, list[str]]:
    extra = {"ignore_eos": True} if args.ignore_eos and name != "transformers" else {}
    with server(name, model, args, log_path) as url:
        model_id = str(model) if name == "transformers" else None
        results, wall = asyncio.run(run_load(url, model_id, prompts, args, extra))
    return summarize(results, wall), [r["text"] for r in results]


def probe_cb(model: Path, args, log_dir: Path) -> str:
    """--tf-mode auto: continuous batching if a server with it answers a request, else plain."""
    args.tf_mode = "cb"
    try:
        run_one("transformers", model, chat_prompts(2, 99), args, str(log_dir / "tf-probe.log"))
        return "cb"
    except Exception as exc:  # noqa: BLE001 - any failure means: fall back to plain generate
        print(f"transformers serve --continuous-batching failed ({exc!s:.300}); using plain", flush=True)
        return "plain"


# ---------------------------------------------------------------- report

def fmt(col: tuple[str, str, str], v: float) -> str:
    return col[2].format(v)


def table(med: dict[str, dict], matches: dict[str, int], tokens: dict[str, int], n: int) -> str:
    head = "| config | " + " | ".join(c[0] for c in COLUMNS) + " | out tokens | texts = transformers |"
    lines = [head, "|---|" + "---:|" * (len(COLUMNS) + 2)]
    for name, m in med.items():
        cells = [fmt(c, m[c[1]]) for c in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {tokens[name]} | {matches.get(name, n)}/{n} |")
    base = med["transformers"]
    for name in PD_FLAGS:
        if name in med:
            cells = [f"{med[name][c[1]] / base[c[1]]:.2f}x" for c in COLUMNS]
            lines.append(f"| {name} / transformers | " + " | ".join(cells) + " | | |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tf-mode", choices=("auto", "cb", "plain"), default="auto",
                   help="transformers serve with --continuous-batching (cb) or without (plain)")
    p.add_argument("--tf-pythonpath", default=None,
                   help="prepended to PYTHONPATH for transformers serve only (e.g. where `accelerate` is)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos to pdserve (transformers serve rejects the field)")
    p.add_argument("--configs", nargs="+", choices=NAMES, default=list(NAMES))
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-tfserve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(Path(tempfile.mkdtemp()) / "llama-bench")
    prompts = chat_prompts(args.num_prompts, args.seed)
    if "transformers" in args.configs and args.tf_mode == "auto":
        args.tf_mode = probe_cb(model, args, log_dir)
    runs: dict[str, list[dict]] = {n: [] for n in args.configs}
    texts: dict[str, list[str]] = {}
    for r in range(args.repeats):
        for name in args.configs:
            m, t = run_one(name, model, prompts, args, str(log_dir / f"{name}-{r}.log"))
            runs[name].append(m)
            texts.setdefault(name, t)
            print(f"repeat {r} {name}: " + json.dumps({k: v for k, v in m.items() if k != "errors"})
                  + (f" errors: {m['errors']}" if m["errors"] else ""), flush=True)
    med = {n: {c[1]: statistics.median(x[c[1]] for x in rs) for c in COLUMNS} for n, rs in runs.items()}
    tokens = {n: int(statistics.median(x["out_tokens"] for x in rs)) for n, rs in runs.items()}
    ref = texts.get("transformers")
    matches = {n: sum(a == b for a, b in zip(t, ref)) for n, t in texts.items()} if ref else {}
    # Byte tokens that end mid-UTF-8 show as U+FFFD, emitted differently by the two servers' streamers
    loose = ({n: sum(a.replace("\ufffd", "") == b.replace("\ufffd", "") for a, b in zip(t, ref))
              for n, t in texts.items()} if ref else {})
    mode = "--continuous-batching" if args.tf_mode == "cb" else "--no-continuous-batching"
    print(f"\n{args.num_prompts} chat prompts, streamed, greedy, max_tokens {args.max_tokens}, concurrency "
          f"{args.concurrency}, medians of {args.repeats} alternating runs; transformers serve {mode}\n")
    print(table(med, matches, tokens, args.num_prompts) if "transformers" in med else json.dumps(med))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(
            {"args": vars(args), "runs": runs, "medians": med, "matches": matches,
             "matches_ignoring_fffd": loose, "texts": texts,
             "source": source_info()}, indent=1))
    print(f"\ntexts equal to transformers' ignoring U+FFFD: {loose}")
    print(f"\nlogs: {log_dir}")


if __name__ == "__main__":
    main()
