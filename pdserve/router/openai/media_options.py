"""The limits on image inputs (router/openai/media.py), as the router's flags set them. Kept free
of heavy imports: the CLI reads the defaults for its --help."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_IMAGES_PER_PROMPT = 8
DEFAULT_MAX_IMAGE_PIXELS = 32 * 2**20  # 32 Mi pixels: a 24-megapixel photo, 128 MiB decoded as RGBA
DEFAULT_FETCH_TIMEOUT_S = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT
DEFAULT_MAX_IMAGE_BYTES = 32 * 2**20  # the router's default --max-body-bytes


@dataclass(frozen=True)
class MediaOptions:
    """The router's limits on image inputs (the flags of the same names)."""
    images_per_prompt: int = DEFAULT_IMAGES_PER_PROMPT  # --limit-mm-per-prompt '{"image": N}'
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # --max-image-pixels
    allowed_domains: tuple[str, ...] = ()  # --allowed-media-domains: none, no http(s) URL is fetched
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S  # --media-fetch-timeout-s
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # a fetched image's size cap: --max-body-bytes
