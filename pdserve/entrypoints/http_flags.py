"""The router's HTTP server flags, as vLLM names them: TLS, CORS, a root path behind a proxy, the
longest request, uvicorn's log level and its access log, and the limits on image inputs
(router/openai/media.py). `pdserve router` and `pdserve up` take them (so `pdserve serve` does
too); `pdserve up` passes them on to its routers (http_flags)."""
from __future__ import annotations

import argparse
import json
import os

from pdserve.entrypoints.engine_flags import add_context_args
from pdserve.router.openai.media_options import (
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_IMAGES_PER_PROMPT,
    DEFAULT_MAX_IMAGE_PIXELS,
)

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def origins(value: str) -> list[str]:
    """--allowed-origins: vLLM's JSON list ('["https://a.example"]'), or a comma list."""
    if value.lstrip().startswith("["):
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"bad --allowed-origins JSON {value!r}: {exc}") from exc
        if not isinstance(parsed, list) or not all(isinstance(o, str) for o in parsed):
            raise argparse.ArgumentTypeError(f"--allowed-origins takes a JSON list of strings, got {value!r}")
        return parsed
    return [o.strip() for o in value.split(",") if o.strip()]


def limit_mm_per_prompt(value: str) -> dict[str, int]:
    """--limit-mm-per-prompt: vLLM's JSON, '{"image": 4}' (a modality's value may also be vLLM's
    {"count": N, ...}); modalities other than image are accepted and change nothing."""
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad --limit-mm-per-prompt JSON {value!r}: {exc}") from exc
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt takes a JSON object like '{{\"image\": 4}}', "
                                         f"got {value!r}")
    limits = {}
    for modality, limit in parsed.items():
        count = limit.get("count") if isinstance(limit, dict) else limit
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: {modality!r} needs a count >= 0, got {limit!r}")
        limits[str(modality)] = count
    return limits


def media_domains(value: str) -> list[str]:
    """One --allowed-media-domains value: a host name, or several separated by commas."""
    return [d.strip() for d in value.split(",") if d.strip()]


def _add_media_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--limit-mm-per-prompt", type=limit_mm_per_prompt, default=None, metavar="JSON",
                   help=f"images per prompt, as vLLM takes it: '{{\"image\": N}}' (default "
                        f"{DEFAULT_IMAGES_PER_PROMPT}; more is a 400)")
    p.add_argument("--allowed-media-domains", type=media_domains, nargs="+", default=None, metavar="DOMAIN",
                   help="hosts whose http(s) image URLs the router fetches: an exact host name, or *.example.com "
                        "for its subdomains (default: none, only data: URLs). A fetch is a request the router "
                        "makes from inside your network: allow only domains you trust")
    p.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help="the most pixels (width x height) an image may have, checked from its header before "
                        "it is decoded (a decompression bomb is a 400)")
    p.add_argument("--media-fetch-timeout-s", type=float, default=DEFAULT_FETCH_TIMEOUT_S,
                   help="seconds an http(s) image fetch may take, redirects included")


def add_http_args(p: argparse.ArgumentParser) -> None:
    add_context_args(p)
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM; with --ssl-certfile)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate chain (PEM)")
    p.add_argument("--allowed-origins", type=origins, default=None, metavar="ORIGINS",
                   help="CORS: origins browsers may call the API from, as a JSON list ('[\"*\"]') or a comma "
                        "list (default: no CORS headers)")
    p.add_argument("--root-path", default="", help="the path prefix a proxy serves the API under (ASGI root_path)")
    p.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="warning",
                   help="the HTTP server's log level (info shows each request's access line)")
    p.add_argument("--disable-log-requests", action="store_true", help="no access log line per request")
    _add_media_args(p)


def check_tls(args: argparse.Namespace) -> None:
    """--ssl-keyfile and --ssl-certfile come together, and name files that exist."""
    key, cert = getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None)
    if bool(key) != bool(cert):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: HTTPS needs the key and its certificate")
    for flag, path in (("--ssl-keyfile", key), ("--ssl-certfile", cert)):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")


def http_flags(args: argparse.Namespace) -> list[str]:
    """The flags above as `pdserve up` passes them to a router (files as absolute paths)."""
    flags = context_flags(args)
    if args.ssl_keyfile:
        flags += ["--ssl-keyfile", os.path.abspath(args.ssl_keyfile), "--ssl-certfile", os.path.abspath(args.ssl_certfile)]
    if args.allowed_origins is not None:
        flags += ["--allowed-origins", json.dumps(args.allowed_origins)]
    flags += ["--root-path", args.root_path] if args.root_path else []
    flags += ["--uvicorn-log-level", args.uvicorn_log_level] if args.uvicorn_log_level != "warning" else []
    flags += ["--disable-log-requests"] if args.disable_log_requests else []
    return flags + _media_flags(args)


def context_flags(args: argparse.Namespace) -> list[str]:
    """--max-model-len and --allow-long-max-model-len as `pdserve up` passes them to the router and nodes."""
    wanted = getattr(args, "max_model_len", None)
    flags = ["--max-model-len", str(wanted)] if wanted else []
    return flags + (["--allow-long-max-model-len"] if getattr(args, "allow_long_max_model_len", False) else [])


def _media_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--limit-mm-per-prompt", json.dumps(args.limit_mm_per_prompt)] if args.limit_mm_per_prompt else []
    if args.allowed_media_domains:
        flags += ["--allowed-media-domains", *(d for group in args.allowed_media_domains for d in group)]
    flags += ["--max-image-pixels", str(args.max_image_pixels)] if args.max_image_pixels != DEFAULT_MAX_IMAGE_PIXELS else []
    if args.media_fetch_timeout_s != DEFAULT_FETCH_TIMEOUT_S:
        flags += ["--media-fetch-timeout-s", str(args.media_fetch_timeout_s)]
    return flags


def url_scheme(args: argparse.Namespace) -> str:
    return "https" if getattr(args, "ssl_certfile", None) else "http"
