"""A chat message's content parts: text, and images by URL (`image_url`), as OpenAI's chat API
sends them. An image part's URL is checked later, by media.py; the Responses API's `input_image`
parts arrive here translated (responses_request.py), naming their own field in source_param."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

_URL = "^(data:|https?://)"  # media.py's schemes (and so not empty); the rest is checked there


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="allow")
    url: str = Field(json_schema_extra={"pattern": _URL}, description="A data: URL (PNG, JPEG or WebP, base64), or an http(s) URL on a domain the "
                                 "server allows (--allowed-media-domains).")
    detail: Literal["auto", "low", "high"] | None = None


# What _image_has_url enforces, for the OpenAPI document: an image part carries a non-empty URL
# (an ImageURL object, whose url has minLength 1, or a bare URL string).
_IMAGE_NEEDS_URL = {"if": {"properties": {"type": {"const": "image_url"}}},
                    "then": {"required": ["image_url"],
                             "properties": {"image_url": {"type": ["object", "string"], "pattern": _URL}}}}


class ContentPart(BaseModel):
    """A text part, or an image part (checked by router/openai/media.py)."""
    model_config = ConfigDict(extra="allow", json_schema_extra=_IMAGE_NEEDS_URL)
    type: Annotated[str, WithJsonSchema({"enum": ["text", "image_url"], "description": "Text and image parts."})]
    text: str = ""
    image_url: ImageURL | str | None = None  # OpenAI's {"url", "detail"}; a bare URL string too, as vLLM takes
    # Where the part came from when it is not messages[i].content[j] (a Responses input part), for errors.
    source_param: SkipJsonSchema[str | None] = Field(None, exclude=True)

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value not in ("text", "image_url"):
            raise ValueError(f"content parts of type {value!r} are not supported (only 'text' and 'image_url')")
        return value

    @model_validator(mode="after")
    def _image_has_url(self) -> ContentPart:
        if self.type == "image_url" and not self.url:
            raise ValueError("an image_url part needs image_url.url")
        return self

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else (self.image_url.url if self.image_url else "")

    @property
    def detail(self) -> str | None:
        return self.image_url.detail if isinstance(self.image_url, ImageURL) else None
