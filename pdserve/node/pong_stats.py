"""What a node reports in its pongs' stats besides its role's own: the engine's load and caches,
its counters (NodeStats), its KV event stream's position, and what its model's parts did
(speculation, the encoder cache, lent cores). The router reads them into /health and /metrics."""
from __future__ import annotations

import dataclasses

from pdserve.engine.footprint import footprint
from pdserve.node.node_stats import NodeStats
from pdserve.spec_decode.speculator import spec_stats


def pong_stats(engine, stats: NodeStats, kv_event_seq: int, integrity_failures: int, switches: int,
               cores) -> dict[str, int]:
    """The stats of a pong: NodeStats' counters, then the engine's (cores: the node's CoreBoard, or None)."""
    out = {k: v for k, v in dataclasses.asdict(stats).items() if isinstance(v, int)}
    sched = engine.scheduler
    out.update(kv_blocks_in_use=engine.pool.num_used, running=len(sched.running),
               waiting=len(sched.waiting), preemptions=sched.num_preemptions,
               cached_tokens=engine.cached_prompt_tokens, computed_tokens=engine.computed_prompt_tokens,
               cached_tokens_local=max(engine.cached_prompt_tokens - stats.cached_tokens_store
                                       - stats.kv_tokens_borrowed, 0),
               cached_blocks=len(engine.pool.cached), kv_event_seq=kv_event_seq,
               prefill_ns_per_token=int(engine.prefill_s_per_token * 1e9),
               integrity_failures=integrity_failures,
               state_slots_in_use=engine.kv.states.num_in_use() if engine.kv.states is not None else 0)
    out.update(role_switches=switches, tensor_parallel_size=engine.config.tensor_parallel_size,
               pipeline_parallel_size=engine.config.pipeline_parallel_size,
               lora_slot_loads=engine.lora.slot_loads if engine.lora is not None else 0,
               **footprint(engine), **spec_stats(engine), **encoder_stats(engine))
    if cores is not None:  # steps run on lent cores (pdserve.node.core_board)
        out.update(lent_core_steps=cores.lent_steps, widest_lent_threads=cores.widest_lent_threads)
    return out


def encoder_stats(engine) -> dict[str, int]:
    """A vision-language model's encoder cache: images found there, images encoded and the
    embeddings those runs gave (nothing for a text model)."""
    stats = engine.encoder_stats
    if stats is None:
        return {}
    return {"encoder_cache_hits": stats.hits, "encoder_runs": stats.encoder_runs,
            "encoded_tokens": stats.encoded_tokens}
