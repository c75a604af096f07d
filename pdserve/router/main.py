"""`pdserve router`: the OpenAI-compatible HTTP front over the cluster's nodes.

The one place the router's objects are built and wired: build_backend puts the cluster backend
together (the node pool, the requests in flight, placement, the prefill and embedding paths,
drains, the health report); build_app adds scaling (the admin scaler, the registry watcher, the
SLA planner loop) and the HTTP app, and starts and stops them with it.
"""
from __future__ import annotations

import asyncio
import logging
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass

from starlette.middleware.cors import CORSMiddleware

from pdserve.cluster.planner import PlannerConfig, SlaPlanner, planner_targets_ms
from pdserve.kvstore.redact import redact_url
from pdserve.models.gguf import checkpoint_name
from pdserve.models.image_prompts import ImagePrompts
from pdserve.models.model_path import eos_token_ids, load_tokenizer, read_model_config, resolve_model_path
from pdserve.protocol.block_keys import kv_entry_dims, kv_layer_count, kv_layout_salt
from pdserve.router.dispatch.adapters import RouterAdapters
from pdserve.router.dispatch.cluster import ClusterBackend, Dispatchers
from pdserve.router.dispatch.drain import DrainTracker
from pdserve.router.dispatch.embeddings import EmbeddingDispatch
from pdserve.router.dispatch.encode import EncodeDispatch
from pdserve.router.dispatch.health_report import HealthReport
from pdserve.router.dispatch.inflight import Inflight
from pdserve.router.dispatch.metrics import RouterMetrics
from pdserve.router.dispatch.node_events import NodeEvents
from pdserve.router.dispatch.nodes import NodePool
from pdserve.router.dispatch.picker import NodePicker
from pdserve.router.dispatch.prefill import PrefillDispatch
from pdserve.router.openai.chat_templates import builtin_chat_template
from pdserve.router.openai.media_options import (
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_IMAGES_PER_PROMPT,
    DEFAULT_MAX_IMAGE_PIXELS,
    MediaOptions,
)
from pdserve.router.placement.index import PrefixIndex
from pdserve.router.placement.keys import BlockKeys
from pdserve.router.placement.kv_events import KVEventTracker
from pdserve.router.placement.pd_decision import Targets
from pdserve.router.placement.placement import Placement
from pdserve.router.placement.policy import Planner, SessionMap
from pdserve.router.routes.app import create_app
from pdserve.router.routes.embedding_routes import EmbeddingOptions, checkpoint_pooling
from pdserve.router.routes.model_routes import served_names
from pdserve.router.routes.tenants import parse_api_keys
from pdserve.router.scaling.planner_loop import PlannerLoop
from pdserve.router.scaling.registry_watcher import RegistryWatcher
from pdserve.router.scaling.scaler import OwnerClient, Scaler
from pdserve.wire.curve_keys import RouterKeys

log = logging.getLogger(__name__)
KEEP_ALIVE_S = 75


def layout_salt(model: str, hf_config, dtype: str, block_size: int) -> bytes:
    """The nodes' block-key salt, from the model config alone (no torch, no weights)."""
    planes, heads, dim = kv_entry_dims(hf_config)
    return kv_layout_salt(model, kv_layer_count(hf_config), heads, dim, dtype, block_size, planes)


def build_backend(prefill_addrs: list[str], decode_addrs: list[str], transfer: str = "nixl",
                  salt: bytes | None = None, block_size: int = 16, prefill_policy: str = "cache_aware",
                  decode_policy: str = "cache_aware", local_prefill_threshold: int = 0,
                  session_affinity: bool = False, registry: str | None = None, placement: str = "threshold",
                  targets: Targets | None = None, lora_modules: dict[str, str] | None = None,
                  curve: RouterKeys | None = None, encode_addrs: list[str] = (), handover: str = "pull") -> ClusterBackend:
    """The cluster backend over these nodes (prefill_addrs may be empty: then each request runs
    whole on a decode node, the monolithic mode). salt: the nodes' block-key salt as the router
    guesses it, used until a node reports its own. registry: where the nodes are found instead
    (the watcher that follows it is build_scaling's). lora_modules: LoRA adapters served at
    start, name -> directory (pdserve.router.dispatch.adapters). encode_addrs: encoder nodes
    (E/P/D, pdserve.router.dispatch.encode). handover: "pull" (the decode node is sent the
    request once its prompt is computed) or "push" (at once, beside the prefill node)."""
    if not decode_addrs and registry is None:
        raise ValueError("the cluster needs at least one decode node, or a registry to find them in")
    pool = NodePool(prefill_addrs, decode_addrs, curve=curve, encode_addrs=encode_addrs)
    adapters = RouterAdapters(lora_modules, pool)
    inflight, picker, metrics, index = Inflight(pool.send_later), NodePicker(pool), RouterMetrics(pool.nodes, pool.faults), PrefixIndex()
    kv_tracker, drains = KVEventTracker(index), DrainTracker(inflight)
    events = NodeEvents(pool, inflight, drains, adapters, index, kv_tracker)
    pool.listen(events.on_message, events.on_dead)
    planner = Planner(index, block_size, prefill_policy, decode_policy, local_prefill_threshold, placement, targets)
    placer = Placement(planner, BlockKeys(block_size, salt, pool.kv_salts),
                       SessionMap() if session_affinity else None)
    dispatch = Dispatchers(pool, inflight, picker, PrefillDispatch(pool, inflight, picker, adapters, metrics, transfer),
                           EmbeddingDispatch(pool, inflight, picker), EncodeDispatch(pool, inflight), drains,
                           HealthReport(pool, index, kv_tracker, drains, adapters, transfer))
    return ClusterBackend(dispatch, placer, adapters, metrics, handover)


@dataclass
class Scaling:
    """What changes the cluster's size: the admin scaler (through the node owner, when there is
    one), the registry watcher (nodes that register), the SLA planner loop (--planner sla)."""
    scaler: Scaler
    watcher: RegistryWatcher | None = None
    planner: PlannerLoop | None = None


def build_scaling(backend: ClusterBackend, owner: str | None = None, registry: str | None = None,
                  planner: PlannerConfig | None = None, planner_interval_s: float = 5.0) -> Scaling:
    """owner: the zmq admin endpoint of whatever starts node processes."""
    scaler = Scaler(backend.pool, backend.dispatch.drains, OwnerClient(owner) if owner else None)
    watcher = RegistryWatcher(registry, backend.pool) if registry is not None else None
    loop = PlannerLoop(backend.metrics, scaler, SlaPlanner(planner), planner_interval_s) if planner else None
    return Scaling(scaler, watcher, loop)


def build_app(model: str, prefill: list[str], decode: list[str], transfer: str, block_size: int = 16,
              dtype: str = "float32", max_model_len: int | None = None, admission: dict | None = None,
              routing: dict | None = None, curve_dir: str | None = None, registry: str | None = None,
              chat: dict | None = None, served_model_names: list[str] | None = None,
              lora_modules: dict[str, str] | None = None, planner: PlannerConfig | None = None,
              planner_interval_s: float = 5.0, media: MediaOptions | None = None):
    """routing: build_backend's policy options, and owner (build_scaling's). chat: chat_template
    (a Jinja file replacing the tokenizer's), tool_call_parser and pooling (/v1/embeddings:
    "last" or "mean"; default: the checkpoint's, else "last"). served_model_names:
    --served-model-name's values (default: the model as given). lora_modules: LoRA adapters
    served at start, name -> directory. planner: the SLA planner's config (--planner sla). media:
    the limits on image inputs."""
    path = resolve_model_path(model)
    hf_config = read_model_config(path)  # no transformers config classes: they import torch
    tokenizer = load_tokenizer(path)
    chat = chat or {}
    if chat.get("chat_template"):
        tokenizer.chat_template = load_chat_template(chat["chat_template"])
    elif builtin_chat_template(model) is not None:  # SmolLM2's own template drops tools
        tokenizer.chat_template = builtin_chat_template(model)
    routing = dict(routing or {})
    owner = routing.pop("owner", None)
    backend = build_backend(prefill, decode, transfer, salt=layout_salt(checkpoint_name(model, path), hf_config,
                                                                         dtype, block_size),
                            block_size=block_size, registry=registry, lora_modules=lora_modules,
                            curve=RouterKeys.load(curve_dir) if curve_dir else None, **routing)
    scaling = build_scaling(backend, owner, registry, planner, planner_interval_s)
    embedding = EmbeddingOptions(chat.get("pooling") or checkpoint_pooling(path) or "last",
                                 getattr(hf_config, "hidden_size", None))
    app = create_app(backend, tokenizer, model, max_model_len or hf_config.max_position_embeddings, admission,
                     tool_call_parser=chat.get("tool_call_parser"), embedding=embedding,
                     served_model_names=served_names(served_model_names, model), model_root=str(path.resolve()),
                     scaler=scaling.scaler, planner=scaling.planner, media=media,
                     image_prompts=ImagePrompts.for_model(path, hf_config),
                     eos_token_ids=eos_token_ids(hf_config, tokenizer))
    _run_with_app(app, backend, scaling)
    return app


def _kv_dtype_name(args) -> str:
    """The nodes' KV dtype as their block-key salt names it (until their pongs report the salt)."""
    kv_cache_dtype = getattr(args, "kv_cache_dtype", "auto")
    if kv_cache_dtype != "auto":
        return {"fp8": "float8_e4m3fn"}.get(kv_cache_dtype, kv_cache_dtype)
    return "float32" if args.dtype == "auto" else args.dtype


def load_chat_template(path: str) -> str:
    """A --chat-template file's Jinja text (as vLLM, a file path; an unreadable one stops the router)."""
    with open(path, encoding="utf-8") as f:
        return f.read()


def _run_with_app(app, backend: ClusterBackend, scaling: Scaling) -> None:
    """Start the backend's sockets and health checks, the planner loop and the registry watcher
    with the app; stop them with it."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a):
        await backend.start()
        if scaling.planner is not None:
            scaling.planner.start()
        watch = asyncio.create_task(scaling.watcher.run()) if scaling.watcher is not None else None
        try:
            async with inner(a) as state:
                yield state
        finally:
            if watch is not None:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
            if scaling.planner is not None:
                await scaling.planner.stop()
            await backend.stop()

    app.router.lifespan_context = lifespan


def planner_config(args) -> PlannerConfig | None:
    """The SLA planner's config when --planner sla."""
    if getattr(args, "planner", "none") != "sla":
        return None
    ttft_ms, itl_ms = planner_targets_ms(args)
    return PlannerConfig(ttft_slo_s=ttft_ms / 1e3, itl_slo_s=itl_ms / 1e3,
                         min_nodes=args.min_nodes, max_nodes=args.max_nodes,
                         min_prefill=args.min_prefill_nodes, min_decode=args.min_decode_nodes)


def operator_targets(args) -> Targets | None:
    """The operator's --ttft-slo-ms/--itl-slo-ms; None when neither is set (requests that set no
    target of their own then have none: no node throttles them)."""
    ttft, itl = getattr(args, "ttft_slo_ms", None), getattr(args, "itl_slo_ms", None)
    if ttft is None and itl is None:
        return None
    return Targets(None if ttft is None else ttft / 1e3, None if itl is None else itl / 1e3)


def media_options(args, max_body_bytes: int) -> MediaOptions:
    """The router's MediaOptions from its flags (entrypoints/http_flags.py); a fetched image is held
    to the body limit."""
    limits = getattr(args, "limit_mm_per_prompt", None) or {}
    domains = [d for group in getattr(args, "allowed_media_domains", None) or [] for d in group]
    return MediaOptions(images_per_prompt=limits.get("image", DEFAULT_IMAGES_PER_PROMPT),
                        max_image_pixels=getattr(args, "max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS),
                        allowed_domains=tuple(domains), max_image_bytes=max_body_bytes,
                        fetch_timeout_s=getattr(args, "media_fetch_timeout_s", DEFAULT_FETCH_TIMEOUT_S))


def run_router(args) -> int:
    import uvicorn  # heavy: the server, only when a router runs

    admission = dict(api_key=args.api_key or os.environ.get("PDSERVE_API_KEY"), protect_metrics=args.protect_metrics,
                     max_body_bytes=args.max_body_bytes, max_queued_requests=args.max_queued_requests)
    parse_api_keys(admission["api_key"])  # a malformed key list stops the start, not each request
    app = build_app(args.model, args.prefill or [], args.decode or [], args.kv_transfer, args.block_size,
                    _kv_dtype_name(args), args.max_model_len, admission,
                    dict(prefill_policy=args.prefill_policy, decode_policy=args.decode_policy,
                         local_prefill_threshold=args.local_prefill_threshold,
                         placement=args.prefill_placement, targets=operator_targets(args),
                         session_affinity=args.session_affinity, owner=args.owner,
                         encode_addrs=args.encode or [], handover=args.handover), args.curve_dir, args.registry,
                    chat=dict(chat_template=args.chat_template, tool_call_parser=args.tool_call_parser,
                              pooling=args.pooling),
                    served_model_names=args.served_model_name, lora_modules=dict(args.lora_modules or []),
                    planner=planner_config(args), planner_interval_s=getattr(args, "planner_interval_s", 5.0),
                    media=media_options(args, args.max_body_bytes))
    log.info("router on http://%s:%d: %d prefill, %d decode nodes, transfer=%s (%s)%s%s", args.host, args.port,
             len(args.prefill or []), len(args.decode or []), args.kv_transfer, args.handover, ", CURVE" if args.curve_dir else "",
             f", nodes from the registry at {redact_url(args.registry)}" if args.registry else "")
    # uvloop and httptools when installed (the [standard] extra): the router's per-request cost is
    # mostly event-loop and HTTP parsing work.
    # Keep-alive: an idle connection must outlive the client's own idle expiry (httpx, the openai
    # client's transport, drops idle connections after 5 s, as uvicorn's default did). With equal
    # timers a client reuses a connection just as the server closes it and gets a ReadError with
    # no bytes; the server side is made the longer one, as nginx (75 s) does.
    if getattr(args, "allowed_origins", None) is not None:  # vLLM's --allowed-origins: CORS for browsers
        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=["*"], allow_headers=["*"])
    uvicorn.run(app, host=args.host, port=args.port, log_level=getattr(args, "uvicorn_log_level", "warning"),
                timeout_graceful_shutdown=2, loop="auto", http="auto", timeout_keep_alive=KEEP_ALIVE_S,
                root_path=getattr(args, "root_path", ""), access_log=not getattr(args, "disable_log_requests", False),
                ssl_keyfile=getattr(args, "ssl_keyfile", None), ssl_certfile=getattr(args, "ssl_certfile", None))
    return 0
