"""vLLM's disaggregated serving as its examples run it (`toy_proxy_server.py` in
examples/online_serving/disaggregated_serving), rewritten here so a benchmark can start it: each
request goes to the prefill server with max_tokens 1 and `kv_transfer_params.do_remote_decode`,
and then, with the `kv_transfer_params` that answer names (its blocks, engine and side channel),
to the decode server, whose NixlConnector READs the blocks before it decodes. The decode server's
answer (a stream or not) is passed through as it comes.

    .venv/bin/python -m benchmarks.peers.vllm_pd_proxy --prefill URL --decode URL --port N

It binds 127.0.0.1 only. Only benchmarks/peers/bench_vs_vllm_pd.py uses it.
"""
from __future__ import annotations

import argparse

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

# What vLLM's proxy sends the prefill server: compute the prompt, keep its blocks for a remote
# decode (until the decode server READs them, or their lease ends).
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_body(body: dict) -> dict:
    first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}
    if "max_completion_tokens" in first:  # chat's name for it
        first["max_completion_tokens"] = 1
    first.pop("stream_options", None)  # only for streams
    return first


def build_app(prefill_url: str, decode_url: str) -> FastAPI:
    app = FastAPI()
    # No timeout: a request waits in a server's queue as long as the load makes it.
    client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    @app.get("/health")
    async def health() -> Response:
        codes = [(await client.get(f"{url}/health")).status_code for url in (prefill_url, decode_url)]
        return Response(status_code=200 if codes == [200, 200] else 503)

    @app.get("/v1/models")
    async def models() -> Response:
        r = await client.get(f"{decode_url}/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.post("/v1/{endpoint:path}")
    async def generate(endpoint: str, request: Request) -> Response:
        body = await request.json()
        first = await client.post(f"{prefill_url}/v1/{endpoint}", json=prefill_body(body))
        if first.status_code != 200:
            return Response(first.content, status_code=first.status_code, media_type="application/json")
        body["kv_transfer_params"] = first.json().get("kv_transfer_params")
        if not body.get("stream"):
            r = await client.post(f"{decode_url}/v1/{endpoint}", json=body)
            return JSONResponse(r.json(), status_code=r.status_code)
        resp = await client.send(client.build_request("POST", f"{decode_url}/v1/{endpoint}", json=body), stream=True)
        return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type", "text/event-stream"),
                                 background=BackgroundTask(resp.aclose))

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefill", required=True, help="the prefill server's URL")
    p.add_argument("--decode", required=True, help="the decode server's URL")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    uvicorn.run(build_app(args.prefill.rstrip("/"), args.decode.rstrip("/")), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
