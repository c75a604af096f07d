"""`pdserve router`: the OpenAI-compatible HTTP front over the cluster's nodes."""
from __future__ import annotations

import logging
import os

from pdserve.protocol.block_keys import kv_entry_dims, kv_layout_salt

log = logging.getLogger(__name__)
KEEP_ALIVE_S = 75


def layout_salt(model: str, hf_config, dtype: str, block_size: int) -> bytes:
    """The nodes' block-key salt, from the model config alone (no torch, no weights)."""
    planes, heads, dim = kv_entry_dims(hf_config)
    return kv_layout_salt(model, hf_config.num_hidden_layers, heads, dim, dtype, block_size, planes)


def build_app(model: str, prefill: list[str], decode: list[str], transfer: str, block_size: int = 16,
              dtype: str = "float32", max_model_len: int | None = None, admission: dict | None = None,
              routing: dict | None = None, curve_dir: str | None = None, registry: str | None = None,
              chat: dict | None = None, served_model_names: list[str] | None = None,
              lora_modules: dict[str, str] | None = None):
    """chat: chat_template (a Jinja file replacing the tokenizer's), tool_call_parser and
    pooling (/v1/embeddings: "last" or "mean"; default: the checkpoint's, else "last").
    served_model_names: --served-model-name's values (default: the model as given).
    lora_modules: LoRA adapters served at start, name -> directory (pdserve.router.dispatch.adapters)."""
    from pdserve.models.gguf import checkpoint_name
    from pdserve.models.model_path import load_tokenizer, read_model_config, resolve_model_path
    from pdserve.router.dispatch.adapters import RouterAdapters
    from pdserve.router.dispatch.cluster import ClusterBackend
    from pdserve.router.dispatch.nodes import NodePool
    from pdserve.router.openai.chat_templates import builtin_chat_template
    from pdserve.router.routes.app import create_app
    from pdserve.router.routes.embedding_routes import EmbeddingOptions, checkpoint_pooling
    from pdserve.router.routes.model_routes import served_names
    from pdserve.wire.curve_keys import RouterKeys

    path = resolve_model_path(model)
    hf_config = read_model_config(path)  # no transformers config classes: they import torch
    tokenizer = load_tokenizer(path)
    chat = chat or {}
    if chat.get("chat_template"):
        tokenizer.chat_template = load_chat_template(chat["chat_template"])
    elif builtin_chat_template(model) is not None:  # SmolLM2's own template drops tools
        tokenizer.chat_template = builtin_chat_template(model)
    salt = layout_salt(checkpoint_name(model, path), hf_config, dtype, block_size)
    NodePool.curve = RouterKeys.load(curve_dir) if curve_dir else None
    backend = ClusterBackend(model, prefill, decode, transfer,
                             salt=salt, block_size=block_size, registry=registry,
                             adapters=RouterAdapters(lora_modules), **(routing or {}))
    embedding = EmbeddingOptions(chat.get("pooling") or checkpoint_pooling(path) or "last",
                                 getattr(hf_config, "hidden_size", None))
    app = create_app(backend, tokenizer, model, max_model_len or hf_config.max_position_embeddings, admission,
                     tool_call_parser=chat.get("tool_call_parser"), embedding=embedding,
                     served_model_names=served_names(served_model_names, model), model_root=str(path.resolve()))
    _run_with_app(app, backend)
    return app


def _kv_dtype_name(args) -> str:
    """The nodes' KV dtype as their block-key salt names it (until their pongs report the salt)."""
    if getattr(args, "kv_cache_dtype", "auto") == "fp8":
        return "float8_e4m3fn"
    return "float32" if args.dtype == "auto" else args.dtype


def load_chat_template(path: str) -> str:
    """A --chat-template file's Jinja text (as vLLM, a file path; an unreadable one stops the router)."""
    with open(path, encoding="utf-8") as f:
        return f.read()


def _run_with_app(app, backend) -> None:
    """Start the backend's sockets and health checks with the app, stop them with it."""
    from contextlib import asynccontextmanager
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a):
        await backend.start()
        try:
            async with inner(a) as state:
                yield state
        finally:
            await backend.stop()

    app.router.lifespan_context = lifespan


def run_router(args) -> int:
    import uvicorn

    from pdserve.kvstore.redact import redact_url
    from pdserve.router.placement.pd_decision import Targets
    from pdserve.router.routes.tenants import parse_api_keys
    from pdserve.router.scaling.planner_loop import attach_planner
    admission = dict(api_key=args.api_key or os.environ.get("PDSERVE_API_KEY"), protect_metrics=args.protect_metrics,
                     max_body_bytes=args.max_body_bytes, max_queued_requests=args.max_queued_requests)
    parse_api_keys(admission["api_key"])  # a malformed key list stops the start, not each request
    app = build_app(args.model, args.prefill or [], args.decode or [], args.kv_transfer, args.block_size,
                    _kv_dtype_name(args), args.max_model_len, admission,
                    dict(prefill_policy=args.prefill_policy, decode_policy=args.decode_policy,
                         local_prefill_threshold=args.local_prefill_threshold,
                         placement=args.prefill_placement, targets=Targets(args.ttft_slo_ms / 1e3, args.itl_slo_ms / 1e3),
                         session_affinity=args.session_affinity, owner=args.owner), args.curve_dir, args.registry,
                    chat=dict(chat_template=args.chat_template, tool_call_parser=args.tool_call_parser,
                              pooling=args.pooling),
                    served_model_names=args.served_model_name, lora_modules=dict(args.lora_modules or []))
    attach_planner(app.state.router.backend, args)
    log.info("router on http://%s:%d: %d prefill, %d decode nodes, transfer=%s%s%s", args.host, args.port,
             len(args.prefill or []), len(args.decode or []), args.kv_transfer, ", CURVE" if args.curve_dir else "",
             f", nodes from the registry at {redact_url(args.registry)}" if args.registry else "")
    # uvloop and httptools when installed (the [standard] extra): the router's per-request cost is
    # mostly event-loop and HTTP parsing work.
    # Keep-alive: an idle connection must outlive the client's own idle expiry (httpx, the openai
    # client's transport, drops idle connections after 5 s, as uvicorn's default did). With equal
    # timers a client reuses a connection just as the server closes it and gets a ReadError with
    # no bytes; the server side is made the longer one, as nginx (75 s) does.
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2,
                loop="auto", http="auto", timeout_keep_alive=KEEP_ALIVE_S)
    return 0
