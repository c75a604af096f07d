"""Fetching an image from an http(s) URL: only from the domains the operator allows.

A fetch is a request the router makes on a client's behalf, from inside the operator's network:
without a check, a client could make the router read internal services (a metadata endpoint,
an admin port on localhost) and learn from the answer or its timing what is there (server-side
request forgery). So an http(s) image URL is refused with a 400 unless its host is in
--allowed-media-domains (vLLM's flag), and the fetch is bounded:

  * the host must equal an allowed entry (case-insensitive, a trailing dot ignored), or, for an
    entry written `*.example.com`, be a subdomain of example.com (not example.com itself);
  * every redirect is followed by hand and its target checked the same way (at most
    MAX_REDIRECTS), so an allowed host cannot send the router elsewhere;
  * the whole fetch, redirects included, has one deadline, and the body one size cap (a
    Content-Length over it is refused before any byte is read);
  * proxies from the environment (HTTP_PROXY...) are not used: the router connects to the host
    the check passed.
The check is by name: a name that an allowed domain's DNS points at an internal address is
reached. Allow only domains whose DNS you trust.
"""
from __future__ import annotations

from urllib.parse import urljoin, urlsplit

import anyio
import httpx

MAX_REDIRECTS = 3


class FetchRefused(ValueError):
    """The URL may not be fetched, or its fetch failed: the message says why (for a 400)."""


def normalize_host(host: str) -> str:
    return host.strip().lower().rstrip(".")


def host_allowed(host: str | None, allowed: tuple[str, ...]) -> bool:
    """Exact match with an entry, or a subdomain of a `*.domain` entry."""
    if not host:
        return False
    host = normalize_host(host)
    for entry in allowed:
        entry = normalize_host(entry)
        if entry.startswith("*."):
            if host.endswith(entry[1:]) and len(host) > len(entry) - 1:
                return True
        elif host == entry:
            return True
    return False


def check_url(url: str, allowed: tuple[str, ...]) -> None:
    """FetchRefused unless `url` is an http(s) URL whose host is allowed."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError as exc:  # e.g. an unclosed [ in an IPv6 host
        raise FetchRefused(f"the image URL is malformed: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise FetchRefused(f"only data: URLs and http(s) URLs are accepted, got a {parts.scheme or 'relative'} URL")
    if not allowed:
        raise FetchRefused("http(s) image URLs are not accepted by this server (the operator allows no "
                           "domains: --allowed-media-domains); send the image inline as a data: URL")
    if not host_allowed(host, allowed):
        raise FetchRefused(f"the domain {host!r} is not allowed for image URLs "
                           "(--allowed-media-domains)")


async def fetch_image_bytes(url: str, allowed: tuple[str, ...], max_bytes: int, timeout_s: float,
                            transport: httpx.AsyncBaseTransport | None = None) -> bytes:
    """The body at `url`, fetched as the module's docstring says (FetchRefused otherwise)."""
    check_url(url, allowed)
    try:
        with anyio.fail_after(timeout_s):
            async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=timeout_s,
                                         transport=transport) as client:
                return await _follow(client, url, allowed, max_bytes)
    except TimeoutError:
        raise FetchRefused(f"fetching the image took longer than {timeout_s:g} s") from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise FetchRefused(f"fetching the image failed: {type(exc).__name__}: {exc}") from None


async def _follow(client: httpx.AsyncClient, url: str, allowed: tuple[str, ...], max_bytes: int) -> bytes:
    for _ in range(MAX_REDIRECTS + 1):
        async with client.stream("GET", url) as response:
            if response.is_redirect:
                url = urljoin(url, response.headers.get("location", ""))
                check_url(url, allowed)  # a redirect to a domain not allowed is refused as the URL would be
                continue
            if response.status_code != 200:
                raise FetchRefused(f"fetching the image answered HTTP {response.status_code}")
            return await _read_capped(response, max_bytes)
    raise FetchRefused(f"fetching the image was redirected more than {MAX_REDIRECTS} times")


async def _read_capped(response: httpx.Response, max_bytes: int) -> bytes:
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise FetchRefused(f"the image is {int(length)} bytes, over the limit of {max_bytes}")
    chunks, seen = [], 0
    async for chunk in response.aiter_bytes():
        seen += len(chunk)
        if seen > max_bytes:
            raise FetchRefused(f"the image is over the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
