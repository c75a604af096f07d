"""Image inputs at the router (pdserve/router/openai/media.py, media_fetch.py): data: URLs decoded
and checked, http(s) URLs fetched only from --allowed-media-domains, the limits, the content
hash; then, since no served model takes images yet, a 400 saying so.

Unit tests of the checks first; then one real cluster (`pdserve up --prefill-nodes 0`, builtin:tiny)
through the official openai client, with a local HTTP server on 127.0.0.1 serving the images:
127.0.0.1 is allowed, `localhost` (the same server under another name) is not. Every bad input
is a 400 in OpenAI's shape naming the part, and a text request afterwards is still served."""
from __future__ import annotations

import asyncio
import base64
import http.server
import io
import json
import os
import random
import struct
import threading
import zlib

import httpx
import openai
import pytest
from PIL import Image, ImageFile

from pdserve.router.openai.errors import APIError
from pdserve.router.openai.media import (
    ImageRef,
    ImageRefused,
    MediaInputs,
    check_image,
    decode_data_url,
)
from pdserve.router.openai.media_fetch import FetchRefused, fetch_image_bytes, host_allowed
from pdserve.router.openai.media_options import MediaOptions
from pdserve.testing.up_cluster import running_cluster

MAX_PIXELS = 1_000_000


def picture(width: int = 32, height: int = 24, mode: str = "RGB", seed: int = 1) -> Image.Image:
    rng = random.Random(seed)  # deterministic noise
    return Image.frombytes(mode, (width, height), bytes(rng.randrange(256) for _ in range(width * height * len(mode))))


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with a few bytes of data: a decompression bomb's shape."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + chunk(b"IEND", b""))


# ---- the checks, one image at a time ------------------------------------------------------------

@pytest.mark.parametrize("fmt,options", [("PNG", {}), ("JPEG", {"quality": 90}), ("WEBP", {"lossless": True})])
def test_png_jpeg_and_webp_data_urls_decode(fmt, options):
    data = encode(picture(), fmt, **options)
    image = check_image(decode_data_url(data_url(data, f"image/{fmt.lower()}")), "p", MAX_PIXELS)
    assert (image.format, image.width, image.height, image.mode) == (fmt, 32, 24, "RGB")
    assert len(image.content_hash) == 32 and image.data == data


def test_same_pixels_as_png_and_lossless_webp_hash_the_same_and_jpeg_differs():
    for mode in ("RGB", "RGBA"):
        pic = picture(mode=mode)
        png = check_image(encode(pic, "PNG"), "p", MAX_PIXELS)
        webp = check_image(encode(pic, "WEBP", lossless=True, exact=True), "p", MAX_PIXELS)
        assert (png.format, webp.format, png.mode) == ("PNG", "WEBP", mode)
        assert png.content_hash == webp.content_hash
    rgb = picture()
    jpeg = check_image(encode(rgb, "JPEG", quality=90), "p", MAX_PIXELS)
    assert jpeg.content_hash != check_image(encode(rgb, "PNG"), "p", MAX_PIXELS).content_hash
    other = check_image(encode(picture(seed=2), "PNG"), "p", MAX_PIXELS)
    assert other.content_hash != check_image(encode(rgb, "PNG"), "p", MAX_PIXELS).content_hash


def test_a_palette_png_hashes_as_its_rgb_pixels():
    pic = picture().quantize(16).convert("RGB")  # 16 colours: the palette PNG holds the same pixels
    palette = encode(pic.quantize(16), "PNG")
    assert Image.open(io.BytesIO(palette)).mode == "P"
    assert check_image(palette, "p", MAX_PIXELS).content_hash == check_image(encode(pic, "PNG"), "p",
                                                                             MAX_PIXELS).content_hash


def test_the_real_format_decides_not_the_media_type():
    jpeg = encode(picture(), "JPEG")
    assert check_image(decode_data_url(data_url(jpeg, "image/png")), "p", MAX_PIXELS).format == "JPEG"
    with pytest.raises(ImageRefused, match="a GIF image: only PNG, JPEG and WebP"):
        check_image(encode(picture(), "GIF"), "p", MAX_PIXELS)
    with pytest.raises(ImageRefused, match="a BMP image"):
        check_image(encode(picture(), "BMP"), "p", MAX_PIXELS)
    with pytest.raises(ImageRefused, match="not a PNG, JPEG or WebP image"):
        check_image(b"hello, not an image at all", "p", MAX_PIXELS)


def test_malformed_data_urls_are_refused():
    png = base64.b64encode(encode(picture(), "PNG")).decode()
    for url, why in [(f"data:text/plain;base64,{png}", "is not an image"), ("data:image/png;base64", "comma"),
                     (f"data:image/png,{png}", "must be base64"), ("data:image/png;base64,@@@@", "base64")]:
        with pytest.raises(ImageRefused, match=why):
            decode_data_url(url)


def test_a_bomb_is_refused_from_its_header_without_decoding(monkeypatch):
    def no_decoding(self):
        raise AssertionError("the pixels were decoded")
    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    with pytest.raises(ImageRefused, match="more than 1000000 pixels"):  # Pillow's own limit, from the header
        check_image(png_header_only(30000, 30000), "p", MAX_PIXELS)
    with pytest.raises(ImageRefused, match="2000x1000 = 2000000 pixels, over the limit of 1000000"):  # ours
        check_image(png_header_only(2000, 1000), "p", MAX_PIXELS)


def test_a_corrupt_or_truncated_image_is_refused():
    png = encode(picture(), "PNG")
    with pytest.raises(ImageRefused, match="PNG image could not be decoded"):
        check_image(png[: len(png) // 2], "p", MAX_PIXELS)
    jpeg = bytearray(encode(picture(), "JPEG"))
    with pytest.raises(ImageRefused, match="JPEG image could not be decoded"):
        check_image(bytes(jpeg[:40]), "p", MAX_PIXELS)


def test_too_many_images_is_a_400_naming_the_first_one_over():
    media = MediaInputs(MediaOptions(images_per_prompt=2))
    url = data_url(encode(picture(), "PNG"))
    refs = [ImageRef(url, f"messages[0].content[{i}].image_url") for i in range(3)]
    with pytest.raises(APIError) as err:
        asyncio.run(media.load(refs))
    assert err.value.status == 400 and err.value.param == "messages[0].content[2].image_url"
    assert "at most 2 images per prompt" in err.value.message
    assert len(asyncio.run(media.load(refs[:2]))) == 2
    with pytest.raises(APIError, match="does not accept image inputs"):  # after the checks pass
        asyncio.run(media.check(refs[:2], "m"))


# ---- which hosts may be fetched ------------------------------------------------------------------

def test_host_allowed_is_an_exact_match_or_a_wildcards_subdomain():
    allowed = ("images.example.com", "*.cdn.example.org")
    assert host_allowed("images.example.com", allowed) and host_allowed("IMAGES.example.com.", allowed)
    assert host_allowed("a.cdn.example.org", allowed) and host_allowed("x.y.cdn.example.org", allowed)
    for host in ("example.com", "evil-images.example.com", "a.images.example.com", "cdn.example.org",
                 "evilcdn.example.org", None, ""):
        assert not host_allowed(host, allowed), host


def _fetch(url: str, transport: httpx.MockTransport, max_bytes: int = 1000) -> bytes:
    return asyncio.run(fetch_image_bytes(url, ("ok.example",), max_bytes, 5.0, transport))


def test_fetches_are_refused_off_the_list_redirected_off_it_or_too_large():
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        routes = {"/img": httpx.Response(200, content=b"x" * 10),
                  "/away": httpx.Response(302, headers={"location": "http://evil.example/img"}),
                  "/here": httpx.Response(301, headers={"location": "/img"}),
                  "/big": httpx.Response(200, content=b"x" * 2000), "/gone": httpx.Response(404)}
        return routes[request.url.path]
    transport = httpx.MockTransport(handler)
    assert _fetch("http://ok.example/img", transport) == b"x" * 10
    assert _fetch("https://ok.example/here", transport) == b"x" * 10  # a redirect on an allowed host
    for url, why in [("http://evil.example/img", "'evil.example' is not allowed"),
                     ("http://ok.example@evil.example/img", "'evil.example' is not allowed"),
                     ("http://ok.example/away", "'evil.example' is not allowed"),
                     ("http://ok.example/big", "2000 bytes, over the limit of 1000"),
                     ("http://ok.example/gone", "answered HTTP 404"), ("ftp://ok.example/img", "ftp URL"),
                     ("file:///etc/passwd", "file URL")]:
        with pytest.raises(FetchRefused, match=why):
            _fetch(url, transport)
    assert not any("evil" in url for url in seen)
    with pytest.raises(FetchRefused, match="the operator allows no domains"):
        asyncio.run(fetch_image_bytes("http://ok.example/img", (), 1000, 5.0, transport))


# ---- over HTTP, against a real router ------------------------------------------------------------

class _Images(http.server.BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}
    requests: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        type(self).requests.append(f"{self.headers.get('host')}{self.path}")
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", self.path.split("to=", 1)[1])
            self.end_headers()
            return
        body = self.files.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_server():
    _Images.files = {"/cat.png": encode(picture(64, 48), "PNG"), "/cat.gif": encode(picture(), "GIF"),
                     "/big.png": b"\x89PNG\r\n\x1a\n" + os.urandom(3 * 10**6)}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture(scope="module")
def served(image_server):
    flags = ("--prefill-nodes", "0", "--decode-nodes", "1", "--allowed-media-domains", "127.0.0.1",
             "--limit-mm-per-prompt", json.dumps({"image": 2}), "--max-image-pixels", str(MAX_PIXELS),
             "--max-body-bytes", str(2 * 10**6))
    with running_cluster(*flags) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        yield url, client, client.models.list().data[0].id, image_server


def _chat_with(client, model, *parts):
    return client.chat.completions.create(model=model, max_tokens=2, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, *parts]}])


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def _assert_400(call, param: str, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    assert err.value.status_code == 400
    error = err.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and says in error["message"], error


def _still_serves(client, model) -> None:
    reply = client.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert reply.usage.completion_tokens == 2


NO_IMAGES = "does not accept image inputs"


def test_a_valid_image_is_checked_then_refused_by_the_text_only_model(served):
    _, client, model, port = served
    for url in (data_url(encode(picture(), "WEBP", lossless=True), "image/webp"), f"http://127.0.0.1:{port}/cat.png"):
        _assert_400(lambda: _chat_with(client, model, _image(url)), "messages[0].content[1].image_url", NO_IMAGES)
    assert f"127.0.0.1:{port}/cat.png" in _Images.requests  # the allowed domain was fetched
    _still_serves(client, model)


BAD_CHAT = [  # (the part, what the 400 says)
    (lambda port: _image(f"http://localhost:{port}/cat.png"), "'localhost' is not allowed"),
    (lambda port: _image(f"http://127.0.0.1:{port}/redirect?to=http://localhost:{port}/cat.png"),
     "'localhost' is not allowed"),
    (lambda port: _image(f"http://127.0.0.1:{port}/missing.png"), "answered HTTP 404"),
    (lambda port: _image(f"http://127.0.0.1:{port}/big.png"), "over the limit of 2000000"),
    (lambda port: _image(f"http://127.0.0.1:{port}/cat.gif"), "a GIF image"),
    (lambda port: _image(data_url(png_header_only(30000, 30000))), "more than 1000000 pixels"),
    (lambda port: _image(data_url(encode(picture(), "PNG")[:60])), "could not be decoded"),
    (lambda port: _image("data:text/html;base64,PGgxPg=="), "is not an image"),
    (lambda port: _image("file:///etc/passwd"), "file URL"),
]


@pytest.mark.parametrize("part,says", BAD_CHAT)
def test_a_bad_image_is_a_400_naming_the_part_and_the_server_goes_on(served, part, says):
    _, client, model, port = served
    _Images.requests.clear()
    _assert_400(lambda: _chat_with(client, model, part(port)), "messages[0].content[1].image_url", says)
    assert not any(r.startswith("localhost") for r in _Images.requests)  # never fetched off the list
    _still_serves(client, model)


def test_too_many_images_and_too_large_a_body(served):
    url, client, model, _ = served
    image = _image(data_url(encode(picture(), "PNG")))
    _assert_400(lambda: _chat_with(client, model, image, image, image), "messages[0].content[3].image_url",
                "at most 2 images per prompt")
    huge = _image(data_url(os.urandom(2 * 10**6)))
    with pytest.raises(openai.APIStatusError) as err:
        _chat_with(client, model, huge)
    assert err.value.status_code == 413
    unknown = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={"model": model, "messages": [
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]})
    assert unknown.status_code == 400 and "only 'text' and 'image_url'" in unknown.json()["error"]["message"]
    _still_serves(client, model)


def test_responses_input_image_and_tokenize(served):
    url, client, model, port = served

    def respond(image_url: str):
        return client.responses.create(model=model, max_output_tokens=2, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Describe it."}, {"type": "input_image", "image_url": image_url}]}])
    param = "input[0].content[1].image_url"
    _assert_400(lambda: respond(data_url(encode(picture(), "PNG"))), param, NO_IMAGES)
    _assert_400(lambda: respond(f"http://localhost:{port}/cat.png"), param, "'localhost' is not allowed")
    _assert_400(lambda: respond(data_url(png_header_only(30000, 30000))), param, "more than 1000000 pixels")
    assert client.responses.create(model=model, max_output_tokens=2, input="hi").usage.output_tokens == 2
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}, _image(data_url(b"GIF89a...."))]}]
    bad = httpx.post(f"{url}/tokenize", json={"model": model, "messages": messages}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].content[1].image_url"
    text = [{"role": "user", "content": [{"type": "text", "text": "x"}]}]
    assert httpx.post(f"{url}/tokenize", json={"model": model, "messages": text}, timeout=30).status_code == 200
