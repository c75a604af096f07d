"""`pdserve scale`: the command-line client of the router's admin routes.

    pdserve scale --url http://127.0.0.1:8000 --prefill 2 --decode 2
    pdserve scale --url http://127.0.0.1:8000 --switch decode-1 --to prefill
    pdserve scale --url http://127.0.0.1:8000            # list the nodes
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 600.0  # a scale answers once new nodes have loaded and removed ones have drained


def add_scale_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the router, e.g. http://127.0.0.1:8000")
    p.add_argument("--prefill", type=int, default=None, help="prefill nodes wanted")
    p.add_argument("--decode", type=int, default=None, help="decode nodes wanted")
    p.add_argument("--switch", metavar="NODE_ID", default=None, help="the node whose role changes")
    p.add_argument("--to", choices=["prefill", "decode"], default=None, help="its new role (with --switch)")
    p.add_argument("--no-wait", action="store_true", help="answer before new nodes have joined")
    p.add_argument("--grace-s", type=float, default=None,
                   help="seconds a draining node's decode streams may run before they resume elsewhere (default 2)")
    p.add_argument("--api-key", default=None, help="the router's API key (default: $PDSERVE_API_KEY)")


def admin_call(url: str, path: str, body: dict | None, api_key: str | None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except urllib.error.URLError as exc:
        raise ValueError(f"cannot reach the router at {url}: {exc.reason}") from exc


def run_scale(args) -> int:
    if (args.switch is None) != (args.to is None):
        raise ValueError("--switch NODE_ID and --to ROLE go together")
    if args.switch is not None and (args.prefill is not None or args.decode is not None):
        raise ValueError("give either --switch/--to or --prefill/--decode, not both")
    api_key = args.api_key or os.environ.get("PDSERVE_API_KEY")
    if api_key:  # the router's $PDSERVE_API_KEY may list several keys (KEY[:TENANT],...): send the first
        # deferred: pdserve.router.routes loads FastAPI, which every process's flag parser would load
        from pdserve.router.routes.tenants import parse_api_keys
        api_key = next(iter(parse_api_keys(api_key)), b"").decode() or None
    if args.switch is not None:
        body = {"node_id": args.switch, "to_role": args.to, "grace_s": args.grace_s}
        status, reply = admin_call(args.url, "/admin/switch", body, api_key)
    elif args.prefill is not None or args.decode is not None:
        body = {"prefill": args.prefill, "decode": args.decode, "wait": not args.no_wait, "grace_s": args.grace_s}
        status, reply = admin_call(args.url, "/admin/scale", body, api_key)
    else:
        status, reply = admin_call(args.url, "/admin/nodes", None, api_key)
    if status != 200:
        print(f"pdserve scale: {reply.get('error', {}).get('message', reply)}", file=sys.stderr)
        return 1
    print(json.dumps(reply, indent=2))
    return 0
