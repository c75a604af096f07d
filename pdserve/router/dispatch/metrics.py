"""The router's Prometheus metrics (GET /metrics).

Request metrics are recorded as requests run. Per-node metrics are read at scrape time from the
nodes' latest Pong reports (every 0.2 s), so a scrape never waits on a node.
Names follow Prometheus conventions: the pdserve_ prefix, units in the name, _total counters.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.protocol.timing import NodeTiming

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5)

# Pong stat -> (metric, kind, extra labels); counters are monotonic per node process.
NODE_GAUGES = {
    "kv_blocks_in_use": ("pdserve_kv_blocks_in_use", "KV blocks held by live requests (idle cached blocks excluded)"),
    "free_blocks": ("pdserve_kv_blocks_free", "KV blocks free (cached or empty)"),
    "running": ("pdserve_node_running_requests", "requests in the node's running batch"),
    "waiting": ("pdserve_node_waiting_requests", "requests queued on the node"),
    "weight_bytes": ("pdserve_node_weight_bytes", "bytes of model weights as the node holds them (quantized: packed)"),
    "kv_bytes_per_token": ("pdserve_node_kv_bytes_per_token", "KV cache bytes one token takes, all layers"),
    "resident_bytes": ("pdserve_node_resident_memory_bytes", "the node process's resident memory"),
}
NODE_COUNTERS = {
    "preemptions": ("pdserve_node_preemptions", "requests preempted (recomputed later)", {}),
    "cached_tokens_local": ("pdserve_prefix_cache_hit_tokens", "prompt tokens served from a cache",
                            {"source": "local"}),
    "cached_tokens_store": ("pdserve_prefix_cache_hit_tokens", "", {"source": "store"}),
    "computed_tokens": ("pdserve_prompt_tokens_computed", "prompt tokens a node computed (found in no cache)", {}),
    "transfer_bytes_nixl": ("pdserve_kv_transfer_bytes", "KV bytes moved", {"path": "nixl"}),
    "transfer_bytes_store": ("pdserve_kv_transfer_bytes", "", {"path": "store"}),
    # push mode: a prefill node's NIXL WRITEs, and on a decode node the bytes they landed
    "transfer_bytes_nixl_written": ("pdserve_kv_transfer_bytes", "", {"path": "nixl_write"}),
    "transfer_us_nixl": ("pdserve_kv_transfer_seconds", "seconds spent moving KV", {"path": "nixl"}),
    "transfer_us_store": ("pdserve_kv_transfer_seconds", "", {"path": "store"}),
    "transfer_us_nixl_written": ("pdserve_kv_transfer_seconds", "", {"path": "nixl_write"}),
    "transfers_failed": ("pdserve_kv_transfer_failures", "KV transfers that failed", {"reason": "pull_failed"}),
    "leases_expired": ("pdserve_kv_transfer_failures", "", {"reason": "lease_expired"}),
    "integrity_failures": ("pdserve_kv_transfer_failures", "", {"reason": "digest_mismatch"}),
    # Vision-language models (pdserve.engine.multimodal): the encoder cache on each node
    "encoder_cache_hits": ("pdserve_encoder_cache_hits", "images whose embeddings the encoder cache held", {}),
    "encoder_runs": ("pdserve_encoder_runs", "images the vision encoder ran on", {}),
    "encoded_tokens": ("pdserve_encoder_tokens", "image embeddings (tokens) the vision encoder produced", {}),
    "embedding_bytes_store": ("pdserve_embedding_transfer_bytes", "image embedding bytes an encoder node "
                              "handed over and a node took (E/P/D)", {"path": "store"}),
    "embedding_bytes_nixl": ("pdserve_embedding_transfer_bytes", "", {"path": "nixl"}),
    "embedding_us_nixl": ("pdserve_embedding_transfer_seconds", "seconds nodes spent reading image embeddings "
                          "over NIXL", {"path": "nixl"}),
    "embeddings_loaded": ("pdserve_embeddings_loaded", "images a prefill node took from an encoder node", {}),
    # Speculative decoding, vLLM's counters (pdserve.spec_decode.speculator.spec_stats)
    "spec_num_drafts": ("pdserve_spec_decode_num_drafts", "decode steps that verified drafts, summed over requests", {}),
    "spec_num_draft_tokens": ("pdserve_spec_decode_num_draft_tokens", "draft tokens proposed", {}),
    "spec_num_accepted_tokens": ("pdserve_spec_decode_num_accepted_tokens", "draft tokens accepted", {}),
}
NODE_COUNTERS.update({f"spec_accepted_pos_{i}": ("pdserve_spec_decode_num_accepted_tokens_per_pos",
                                                 "draft tokens accepted, by position in the draft" if i == 0 else "",
                                                 {"position": str(i)}) for i in range(32)})


class NodeCollector:
    """Per-node series from each node's last report."""

    def __init__(self, nodes, faults=None):
        self.nodes = nodes  # the live list of router.nodes.Node
        self.faults = faults  # the pool's NodeFaults

    def collect(self):
        healthy = GaugeMetricFamily("pdserve_node_healthy", "1 when the node answers pings", labels=["node", "role"])
        gauges = {k: GaugeMetricFamily(name, doc, labels=["node"]) for k, (name, doc) in NODE_GAUGES.items()}
        families: dict[str, CounterMetricFamily] = {}
        for node in self.nodes:
            healthy.add_metric([node.node_id, node.role], 1.0 if node.healthy else 0.0)
            for key, family in gauges.items():
                if key in node.stats:
                    family.add_metric([node.node_id], float(node.stats[key]))
            for key, (name, doc, labels) in NODE_COUNTERS.items():
                if key not in node.stats:
                    continue
                family = families.get(name) or families.setdefault(
                    name, CounterMetricFamily(name, doc, labels=["node", *labels]))
                value = node.stats[key] / 1e6 if "_us_" in key else node.stats[key]
                family.add_metric([node.node_id, *labels.values()], float(value))
        yield healthy
        if self.faults is not None:
            yield from _node_faults(self.faults)
        yield from gauges.values()
        yield from families.values()


def _node_faults(faults):
    """The faults the router saw of each node (a NodeFaults): losses by how it noticed, and returns."""
    losses = CounterMetricFamily("pdserve_node_losses", "times a node left the rotation: its connection closed "
                                 "(a dead process), it sent no pong in time (hung or cut off), or it was refused",
                                 labels=["node", "role", "reason"])
    rejoins = CounterMetricFamily("pdserve_node_rejoins", "times a lost node answered again (restarted or woke up)",
                                  labels=["node", "role"])
    for labels, count in sorted(faults.losses.items()):
        losses.add_metric(list(labels), float(count))
    for labels, count in sorted(faults.rejoins.items()):
        rejoins.add_metric(list(labels), float(count))
    yield losses
    yield rejoins


class RouterMetrics:
    def __init__(self, nodes=None, faults=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve_request_ttft_seconds", "time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_request_inter_token_latency_seconds", "time between tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_request_e2e_latency_seconds", "request latency", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.queue = Histogram("pdserve_request_queue_time_seconds", "arrival to dispatch to a node",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.stages = Histogram("pdserve_request_stage_seconds", "where a request's time went, by stage (STAGES)",
                                ["stage"], buckets=STAGE_BUCKETS, registry=r)
        self.finished = Counter("pdserve_requests", "finished requests", ["finish_reason"], registry=r)
        self.errors = Counter("pdserve_request_errors", "failed requests", ["kind"], registry=r)
        self.retries = Counter("pdserve_request_retries", "phases retried on another node", ["role"], registry=r)
        self.failovers = Counter("pdserve_failovers", "requests moved off a lost node", ["role"], registry=r)
        self.aborts = Counter("pdserve_request_aborts", "requests whose client left (or that were aborted), by the "
                              "stage they were in: queued, prefill, handover, decode", ["stage"], registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "generated tokens", registry=r)
        self.cached_tokens = Counter("pdserve_cached_prompt_tokens", "prompt tokens served from any cache",
                                     registry=r)
        self.handovers = Counter("pdserve_kv_handovers", "KV handovers by path", ["path"], registry=r)
        if nodes is not None:
            r.register(NodeCollector(nodes, faults))

    def render(self) -> bytes:
        return generate_latest(self.registry)


# The TTFT breakdown (pdserve_request_stage_seconds{stage}). The first token's stages add up to
# its TTFT: the router's, then on the node that computed the prompt (the prefill node, or the
# decode node placed to prefill it) its queue, its KV load (a stored prefix) and its compute, a
# prefill node's handover (store put, NIXL pins), and the rest: messages between router and
# node ("wire"). A handed-over request's decode node adds the pull of its KV ("transfer") and its
# first decode step, which the second token waits for (pull mode: the first comes from prefill).
STAGES = ("router", "queue", "load", "compute", "handover", "wire", "transfer", "first_decode_step")


class RequestTimer:
    """Times one backend request's stream: TTFT and its stages, inter-token gaps, end to end."""

    def __init__(self, metrics: RouterMetrics | None, num_prompt_tokens: int):
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.first = True
        self.router_s: float | None = None  # arrival -> the prompt's first dispatch to a node
        self.decode_timed = False  # the decode node's first step is in the breakdown
        if metrics is not None:
            metrics.prompt_tokens.inc(num_prompt_tokens)

    def dispatched(self) -> None:
        if self.metrics is not None and self.router_s is None:
            self.router_s = time.perf_counter() - self.start
            self.metrics.queue.observe(self.router_s)

    def tokens(self, n: int, cached_tokens: int = 0, timing: NodeTiming | None = None) -> None:
        """n tokens arrived; timing: the node's (protocol.timing) with its first output."""
        if self.metrics is None or n == 0:
            return
        now = time.perf_counter()
        if self.first:
            self.metrics.ttft.observe(now - self.start)
            self._first_token_stages(now - self.start, timing)
            self.metrics.cached_tokens.inc(cached_tokens)
            self.first = False
        else:
            if timing is not None and not self.decode_timed:
                self.metrics.stages.labels("transfer").observe(timing.load_s)
                self.metrics.stages.labels("first_decode_step").observe(timing.queue_s + timing.compute_s)
                self.decode_timed = True
            self.metrics.itl.observe((now - self.last) / n)
        self.last = now
        self.metrics.generation_tokens.inc(n)

    def _first_token_stages(self, ttft_s: float, timing: NodeTiming | None) -> None:
        if timing is None:  # a node that does not say
            return
        router_s = self.router_s or 0.0
        parts = {"router": router_s, "queue": timing.queue_s, "load": timing.load_s,
                 "compute": timing.compute_s, "handover": timing.handover_s}
        parts["wire"] = max(ttft_s - sum(parts.values()), 0.0)
        for stage, seconds in parts.items():
            self.metrics.stages.labels(stage).observe(seconds)

    def finished(self, reason: str | None) -> None:
        if self.metrics is not None:
            self.metrics.e2e.observe(time.perf_counter() - self.start)
            self.metrics.finished.labels(reason or "unknown").inc()
