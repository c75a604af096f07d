"""The load generator's HTTP side: one streamed completion read into a RequestResult, over
aiohttp (C-parsed HTTP, as vLLM's `bench serve` uses). The client runs on the machine it
measures, and each token it reads takes CPU from the server: httpx's streaming took about 115 us
of CPU a token (pure-Python h11), aiohttp about 30 (docs/benchmarks/vs-vllm.md)."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdserve.loadgen.metrics import RequestResult
from pdserve.loadgen.stages import parse_stages


class _StreamTracker:
    """Turns SSE events into timings; an event carrying text or ids counts as a token arrival."""

    def __init__(self, result: RequestResult, start: float) -> None:
        self.result = result
        self.start = start
        self.last = start
        self.chunk_tokens = 0

    def on_event(self, event: dict[str, Any], now: float) -> None:
        if "error" in event:
            self.result.error = str(event["error"].get("message", event["error"]))
        if event.get("usage"):
            usage = event["usage"]
            self.result.prompt_tokens = usage.get("prompt_tokens", 0)
            self.result.output_tokens = usage.get("completion_tokens", 0)
            self.result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        for choice in event.get("choices") or []:
            ids = choice.get("token_ids") or []
            if choice.get("text") or ids:
                self._on_tokens(choice.get("text") or "", ids, now)

    def _on_tokens(self, text: str, ids: list[int], now: float) -> None:
        if self.result.ttft_s is None:
            self.result.ttft_s = now - self.start
        else:
            self.result.itls_s.append(now - self.last)
        self.last = now
        self.chunk_tokens += len(ids) or 1
        self.result.text += text
        self.result.token_ids.extend(ids)


@dataclass
class Client:
    """The run's HTTP session and the server's base URL (paths are joined to it)."""
    session: aiohttp.ClientSession
    base_url: str

    def url(self, path: str) -> str:
        return self.base_url + path


def _parse_sse(line: bytes) -> dict[str, Any] | None | str:
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    return "[DONE]" if data == b"[DONE]" else json.loads(data)


async def _sse_events(resp: aiohttp.ClientResponse):
    """The response's SSE data events, parsed. Lines are split here rather than by
    StreamReader.readline, whose buffer limit a long first chunk (a prompt's token ids) exceeds."""
    pending = b""
    async for chunk in resp.content.iter_any():
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            event = _parse_sse(line)
            if event is not None:
                yield event


async def stream_completion(client: Client, payload: dict[str, Any], prompt_tokens: int) -> RequestResult:
    """One streamed /v1/completions request: its timings and tokens, or its error."""
    result = RequestResult(prompt_tokens=prompt_tokens)
    start = time.perf_counter()
    tracker = _StreamTracker(result, start)
    try:
        async with client.session.post(client.url("/v1/completions"), json=payload) as resp:
            if resp.status != 200:
                body = (await resp.read()).decode(errors="replace")
                result.error = f"HTTP {resp.status}: {body[:300]}"
                return result
            async for event in _sse_events(resp):
                if event == "[DONE]":
                    break
                if isinstance(event, dict):
                    tracker.on_event(event, time.perf_counter())
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e_s = time.perf_counter() - start
    result.output_tokens = result.output_tokens or tracker.chunk_tokens
    result.success = result.error is None and result.ttft_s is not None
    return result


async def scrape_router_stages(client: Client) -> dict[str, dict] | None:
    """The router's stage histograms (pdserve.loadgen.stages); None from a server without them."""
    try:
        async with client.session.get(client.url("/metrics")) as resp:
            return parse_stages(await resp.text()) if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


async def first_model(client: Client) -> str:
    """The first model the server lists."""
    async with client.session.get(client.url("/v1/models"), raise_for_status=True) as resp:
        return (await resp.json())["data"][0]["id"]
