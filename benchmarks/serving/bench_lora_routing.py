"""Adapter-aware routing: adapter slot loads on the decode nodes with round_robin against
cache_aware (which prefers the nodes that have the request's adapter resident), same workload.

Cluster: `pdserve up` with 2 decode nodes and no prefill node (whole requests on the decode
nodes), 4 LoRA adapters (PEFT, rank 8) and --max-loras 2 per node, so a node that serves all
four adapters must swap them. Workload: --chats multi-round chats (chat i on adapter i % 4), 4
running at once; each round sends the conversation so far plus a new user turn (token ids).
A slot load is an adapter copied into a node's slots (the node's lora_slot_loads in /health).

    .venv/bin/python -m benchmarks.serving.bench_lora_routing
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import random
import tempfile
from pathlib import Path

import httpx
import torch

from benchmarks.support.cluster import local_cluster

CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.2)


def build(root: Path, adapters: int, rank: int) -> tuple[Path, dict[str, str]]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pdserve.models.builtin import build_byte_tokenizer
    torch.manual_seed(0)
    base = root / "base"
    tokenizer = build_byte_tokenizer()  # the router tokenizes: the checkpoint needs one
    config = LlamaConfig(**CONFIG, vocab_size=len(tokenizer), architectures=["LlamaForCausalLM"])
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    paths = {}
    for i in range(adapters):
        torch.manual_seed(10 + i)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)),
                               LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                                          target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
        model.save_pretrained(root / f"a{i}")
        paths[f"a{i}"] = str(root / f"a{i}")
    return base, paths


def chat(url: str, adapter: str, rounds: int, seed: int) -> None:
    rng = random.Random(seed)
    conversation: list[int] = []
    for _ in range(rounds):
        conversation += [rng.randrange(3, 250) for _ in range(24)]  # the next user turn
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": adapter, "prompt": conversation, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        r.raise_for_status()
        conversation += r.json()["choices"][0]["token_ids"]


def run(base: Path, adapters: dict[str, str], policy: str, chats: int, rounds: int) -> dict[str, int]:
    flags = ("--model", str(base), "--prefill-nodes", "0", "--decode-nodes", "2", "--decode-policy", policy,
             "--num-kv-blocks", "512", "--max-loras", "2", "--max-lora-rank", "8",
             "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()))
    with local_cluster(*flags) as c:
        names = list(adapters)
        with cf.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: chat(c.url, names[i % len(names)], rounds, i), range(chats)))
        return {node_id: n.get("lora_slot_loads", 0) for node_id, n in c.nodes().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    base, adapters = build(Path(tempfile.mkdtemp(prefix="bench-lora-routing-")), 4, 8)
    loads = {policy: run(base, adapters, policy, args.chats, args.rounds) for policy in ("round_robin", "cache_aware")}
    requests = args.chats * args.rounds
    print(f"{args.chats} chats x {args.rounds} rounds = {requests} requests, 4 adapters, 2 decode nodes, "
          "--max-loras 2")
    print("| decode policy | slot loads (per node) | total |")
    print("|---|---|---|")
    for policy, per_node in loads.items():
        print(f"| {policy} | {', '.join(f'{k}: {v}' for k, v in sorted(per_node.items()))} | {sum(per_node.values())} |")
    avoided = sum(loads["round_robin"].values()) - sum(loads["cache_aware"].values())
    print(f"adapter loads avoided against round robin: {avoided}")


if __name__ == "__main__":
    main()
