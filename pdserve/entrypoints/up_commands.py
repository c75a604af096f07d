"""The command lines `pdserve up` starts its router and nodes with, from its own flags: what each
process is told of the model, the engine, the store and the routing (pdserve.entrypoints.launcher
adds each node's identity, addresses, keys and registry)."""
from __future__ import annotations

import os
import sys

from pdserve.cluster.planner import placement_flags, planner_flags
from pdserve.engine.config import lora_flags
from pdserve.entrypoints.http_flags import context_flags, http_flags

FORWARDED_ENGINE_FLAGS = ("model", "dtype", "block_size", "num_kv_blocks", "kv_cache_memory_gb",
                          "max_num_batched_tokens", "max_num_seqs", "kernel_backend", "encoder_cache_tokens",
                          "cpu_gemm_dtype")


def node_engine_flags(args) -> list[str]:
    """The engine flags every node gets, as `pdserve up` was given them."""
    flags = []
    for flag in FORWARDED_ENGINE_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            flags += [f"--{flag.replace('_', '-')}", str(value)]
    if not args.enable_prefix_caching:
        flags.append("--no-enable-prefix-caching")
    if getattr(args, "enforce_eager", False):
        flags.append("--enforce-eager")
    if getattr(args, "kv_cache_prefault", None) is not None:
        flags.append("--kv-cache-prefault" if args.kv_cache_prefault else "--no-kv-cache-prefault")
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    flags += lora_flags(args)
    flags += context_flags(args)  # a node past the config's positions needs both to run them
    flags += ["--seed", str(args.seed)] if getattr(args, "seed", None) is not None else []
    return flags


def router_command(args, owner: str) -> list[str]:
    """The router's command line, up to its node addresses, keys and registry; owner is where it
    sends the launcher its scale requests."""
    a = args
    router = [sys.executable, "-m", "pdserve", "--log-level", a.log_level, "router", "--model", a.model,
              "--host", a.host, "--port", str(a.port), "--kv-transfer", a.kv_transfer,
              "--block-size", str(a.block_size), "--dtype", a.dtype]
    router += ["--kv-cache-dtype", a.kv_cache_dtype] if getattr(a, "kv_cache_dtype", "auto") != "auto" else []
    router += ["--max-queued-requests", str(a.max_queued_requests), "--max-body-bytes", str(a.max_body_bytes)]
    router += ["--prefill-policy", a.prefill_policy, "--decode-policy", a.decode_policy,
               "--local-prefill-threshold", str(a.local_prefill_threshold)]
    router += placement_flags(a)
    router += ["--session-affinity"] if a.session_affinity else []
    router += planner_flags(a)
    router += ["--chat-template", os.path.abspath(a.chat_template)] if a.chat_template else []
    router += ["--tool-call-parser", a.tool_call_parser] if a.tool_call_parser else []
    router += ["--served-model-name", *a.served_model_name] if a.served_model_name else []
    router += ["--pooling", a.pooling] if getattr(a, "pooling", None) else []
    router += lora_flags(a, router=True)
    router += http_flags(a)
    router += ["--protect-metrics"] if a.protect_metrics else []
    return router + ["--owner", owner]


def store_flags(args, store: str | None) -> list[str]:
    """--store and the LMCache store's options, as every node gets them."""
    if not store:
        return []
    flags = ["--store", store]
    if args.store_chunk_tokens is not None:
        flags += ["--store-chunk-tokens", str(args.store_chunk_tokens)]
    if args.lmcache_config:
        flags += ["--lmcache-config", os.path.abspath(args.lmcache_config)]
    return flags
