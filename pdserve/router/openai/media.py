"""Image inputs at the router's door: an image part's URL becomes a checked image, or a 400.

Chat's `image_url` parts and the Responses API's `input_image` parts (translated to them) name
an image by URL:
  * `data:image/...;base64,...`: decoded here. The bytes decide the format, not the media type
    in the URL (which must only be an image/ one): PNG, JPEG or WebP, recognised by their magic
    numbers and then opened by Pillow with only that format's plugin;
  * `http(s)://...`: fetched only from --allowed-media-domains (media_fetch.py, which says why:
    a fetch is a server-side request), within --media-fetch-timeout-s and the body limit.
Every image is checked before its pixels are decoded: its header's size against
--max-image-pixels (a decompression bomb: a small file that claims a huge picture is refused
from its header). Then the pixels are decoded (a truncated or corrupt file is refused) and
hashed: xxhash of the pixels in a canonical mode (RGB, or RGBA when the image has alpha) with
that mode and the size, so one picture sent as PNG or as lossless WebP hashes the same (a JPEG
re-encode changes the pixels, so its hash).

At most --limit-mm-per-prompt images per prompt (vLLM's `{"image": N}`), counted before any is
fetched. Each refusal is a 400 naming the part (`messages[0].content[1].image_url`). Decoding
runs in worker threads, a few at a time (DECODE_SLOTS), so the event loop keeps serving.

A text model refuses a request with images after the checks (a 400 saying the model does not
accept image inputs). For a vision-language model, `MediaInputs.expand` runs the model's image
processor (pdserve.models.image_prompts) on the checked images and expands the tokenized
prompt's placeholders; the ImageInputs it gives (with the processed pixels' hash, which keys the
blocks of the image's tokens) travel with the request to the nodes.
"""
from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass, field

import anyio
import xxhash
from PIL import Image

from pdserve.models.image_prompts import ImagePrompts
from pdserve.protocol.multimodal import ImageInput
from pdserve.router.openai.errors import bad_request
from pdserve.router.openai.media_fetch import FetchRefused, fetch_image_bytes
from pdserve.router.openai.media_options import MediaOptions

DECODE_SLOTS = 2  # images decoded at once, across requests: a bound on the memory decoding takes

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP")
# Magic numbers: the supported formats, and others named in the refusal.
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"),
          (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"\x00\x00\x01\x00", "ICO"))


@dataclass(frozen=True)
class ImageRef:
    """An image part of a request: its URL, and the request field that holds it (for errors)."""
    url: str
    param: str
    detail: str | None = None


@dataclass(frozen=True)
class CheckedImage:
    """An image that passed every check. data: the encoded bytes as received (what a model's
    image processor will decode again); content_hash: see the module's docstring."""
    param: str
    format: str  # PNG, JPEG or WEBP: what the bytes are
    width: int
    height: int
    mode: str  # the canonical mode hashed: RGB or RGBA
    content_hash: str  # hex xxh3-128
    data: bytes = field(repr=False)


class ImageRefused(ValueError):
    """An image failed a check; the message says which (for a 400)."""


def sniff_format(data: bytes) -> str | None:
    """The image format the bytes' magic number names (None: not one of the known ones)."""
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if len(data) >= 12 and data[4:8] == b"ftyp":
        return "AVIF/HEIF"
    return next((name for magic, name in _MAGIC if data.startswith(magic)), None)


def decode_data_url(url: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL (ImageRefused when it is not one)."""
    header, comma, payload = url.partition(",")
    if not comma:
        raise ImageRefused("a data: URL needs a comma before its data")
    params = header[len("data:"):].split(";")
    media_type = params[0].strip().lower()
    if not media_type.startswith("image/"):
        raise ImageRefused(f"a data: URL of media type {media_type or 'text/plain'!r} is not an image")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise ImageRefused("an image data: URL must be base64 (data:image/png;base64,...)")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageRefused(f"the data: URL's base64 is malformed: {exc}") from None


def canonical(image: Image.Image) -> Image.Image:
    """The image in RGB, or RGBA when it has alpha (a palette's transparency included)."""
    alpha = "A" in image.getbands() or "transparency" in image.info
    mode = "RGBA" if alpha else "RGB"
    return image if image.mode == mode else image.convert(mode)


def content_hash(image: Image.Image) -> str:
    """xxh3-128 of a canonical image's mode, size and pixels."""
    h = xxhash.xxh3_128()
    h.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def check_image(data: bytes, param: str, max_pixels: int) -> CheckedImage:
    """Opens, bounds, decodes and hashes one image (ImageRefused on any failure). The size is
    read from the header and checked before a pixel is decoded."""
    real = sniff_format(data)
    if real not in SUPPORTED_FORMATS:
        what = f"a {real} image" if real else "not a PNG, JPEG or WebP image"
        raise ImageRefused(f"the image is {what}: only PNG, JPEG and WebP are supported")
    try:
        with Image.open(io.BytesIO(data), formats=[real]) as image:
            _check_size(image.size, max_pixels)
            image.load()  # decodes: a truncated or corrupt file fails here
            canon = canonical(image)
            return CheckedImage(param, real, image.width, image.height, canon.mode, content_hash(canon), data)
    except Image.DecompressionBombError:  # Pillow's own limit (2 x MAX_IMAGE_PIXELS), from the header
        raise ImageRefused(f"the image has more than {max_pixels} pixels (--max-image-pixels)") from None
    except ImageRefused:
        raise
    except Exception as exc:  # Pillow's decoders raise many types on hostile input (OSError, SyntaxError...)
        raise ImageRefused(f"the {real} image could not be decoded: {type(exc).__name__}: {exc}") from None


def _check_size(size: tuple[int, int], max_pixels: int) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise ImageRefused(f"the image's header gives an empty size {width}x{height}")
    if width * height > max_pixels:
        raise ImageRefused(f"the image is {width}x{height} = {width * height} pixels, over the limit of "
                           f"{max_pixels} (--max-image-pixels)")


class MediaInputs:
    """The router's image checks, with its options; image_prompts: the served vision-language
    model's image processing (None: the model takes no images)."""

    def __init__(self, options: MediaOptions | None = None, image_prompts: ImagePrompts | None = None,
                 transport=None) -> None:
        self.options = options or MediaOptions()
        self.image_prompts = image_prompts
        self.transport = transport  # an httpx transport for fetches (tests); None: the network
        self._decode_slots = anyio.CapacityLimiter(DECODE_SLOTS)

    async def load(self, refs: list[ImageRef]) -> list[CheckedImage]:
        """Every image checked, in order; the first failure is a 400 naming its part."""
        limit = self.options.images_per_prompt
        if len(refs) > limit:
            raise bad_request(f"{refs[limit].param}: at most {limit} images per prompt are accepted, got "
                              f"{len(refs)} (--limit-mm-per-prompt)", refs[limit].param)
        return [await self._load_one(ref) for ref in refs]

    async def _load_one(self, ref: ImageRef) -> CheckedImage:
        try:
            data = await self._bytes(ref.url)
            return await anyio.to_thread.run_sync(check_image, data, ref.param, self.options.max_image_pixels,
                                                  limiter=self._decode_slots)
        except (ImageRefused, FetchRefused) as exc:
            raise bad_request(f"{ref.param}: {exc}", ref.param) from None

    async def _bytes(self, url: str) -> bytes:
        if url[:5].lower() == "data:":
            return decode_data_url(url)
        o = self.options
        return await fetch_image_bytes(url, o.allowed_domains, o.max_image_bytes, o.fetch_timeout_s, self.transport)

    async def check(self, refs: list[ImageRef], model: str) -> list[CheckedImage]:
        """The request's images, checked; then a 400 if there are any and the model takes none."""
        images = await self.load(refs)
        if images and self.image_prompts is None:
            raise bad_request(f"The model `{model}` does not accept image inputs (it is a text-only model)",
                              refs[0].param)
        return images

    async def expand(self, prompt_token_ids: list[int], images: list[CheckedImage]
                     ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt with each image's placeholder expanded, and the images' inputs (the model's
        image processor runs in a worker thread); a 400 when placeholders and images differ."""
        if not images:
            return prompt_token_ids, ()
        try:
            ids, inputs = await anyio.to_thread.run_sync(self._expand, prompt_token_ids, images,
                                                         limiter=self._decode_slots)
        except ValueError as exc:
            raise bad_request(f"{images[0].param}: {exc}", images[0].param) from None
        return ids, tuple(inputs)

    def _expand(self, prompt_token_ids: list[int], images: list[CheckedImage]):
        pictures = []
        for image in images:
            with Image.open(io.BytesIO(image.data), formats=[image.format]) as picture:
                pictures.append(canonical(picture).convert("RGB"))
        return self.image_prompts.expand(prompt_token_ids, pictures)
