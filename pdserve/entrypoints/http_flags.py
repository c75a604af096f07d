"""The router's HTTP server flags, as vLLM names them: TLS, CORS, a root path behind a proxy, the
longest request, uvicorn's log level and its access log. `pdserve router` and `pdserve up` take
them (so `pdserve serve` does too); `pdserve up` passes them on to its routers (http_flags)."""
from __future__ import annotations

import argparse
import json
import os

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


def add_http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM; with --ssl-certfile)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate chain (PEM)")
    p.add_argument("--allowed-origins", type=origins, default=None, metavar="ORIGINS",
                   help="CORS: origins browsers may call the API from, as a JSON list ('[\"*\"]') or a comma "
                        "list (default: no CORS headers)")
    p.add_argument("--root-path", default="", help="the path prefix a proxy serves the API under (ASGI root_path)")
    p.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="warning",
                   help="the HTTP server's log level (info shows each request's access line)")
    p.add_argument("--disable-log-requests", action="store_true", help="no access log line per request")


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
    flags = ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    if args.ssl_keyfile:
        flags += ["--ssl-keyfile", os.path.abspath(args.ssl_keyfile), "--ssl-certfile", os.path.abspath(args.ssl_certfile)]
    if args.allowed_origins is not None:
        flags += ["--allowed-origins", json.dumps(args.allowed_origins)]
    flags += ["--root-path", args.root_path] if args.root_path else []
    flags += ["--uvicorn-log-level", args.uvicorn_log_level] if args.uvicorn_log_level != "warning" else []
    return flags + (["--disable-log-requests"] if args.disable_log_requests else [])


def url_scheme(args: argparse.Namespace) -> str:
    return "https" if getattr(args, "ssl_certfile", None) else "http"
