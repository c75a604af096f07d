"""vLLM's run-time adapter routes: POST /v1/load_lora_adapter {lora_name, lora_path} and
POST /v1/unload_lora_adapter {lora_name}. Under /v1/, so behind the API key like every other
route there (AdmissionMiddleware). They answer plain text on success, as vLLM does, and
OpenAI-shaped errors: 400 for a name already served or an adapter a node refuses, 404 for
unloading an adapter not loaded. See pdserve.router.dispatch.adapters for how they reach the nodes."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from pdserve.router.dispatch.adapters import AdapterError
from pdserve.router.openai.errors import NOT_FOUND, APIError, bad_request, error_responses
from pdserve.router.routes.model_routes import ServedModel

_TEXT_200 = {200: {"description": "Success, as plain text (as vLLM answers)",
                   "content": {"text/plain": {"schema": {"type": "string"}}}}}
# A model name: no spaces. \s differs between pydantic's (Rust) regex, Python's and the ECMA regex of
# JSON Schema (\x85 and \x1c-\x1f are space to some, \ufeff to another): naming them all makes the
# document's pattern mean what the server checks.
_NAME = Field(min_length=1, max_length=256, pattern=r"^[^\s\x1c-\x1f\x85\ufeff]+$")


class LoadLoRABody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's body may carry more (load_inplace, ...)
    lora_name: str = _NAME
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRABody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # lora_int_id, as vLLM's clients send it
    lora_name: str = _NAME


def add_lora_routes(app: FastAPI, served: ServedModel) -> None:
    adapters = served.adapters

    # response_class=Response: the 200 is text, and errors stay application/json.
    @app.post("/v1/load_lora_adapter", response_class=Response,
              responses={**_TEXT_200, **error_responses(400, 401, 404, 413, 500)})
    async def load_lora_adapter(body: LoadLoRABody) -> PlainTextResponse:
        if adapters.pool is None:
            raise bad_request("this router's backend serves no LoRA adapters")
        if not adapters.enabled_anywhere():  # as vLLM, whose route exists only with --enable-lora
            raise APIError(404, "LoRA adapters are off on this cluster: start it with --enable-lora or "
                           "--lora-modules", NOT_FOUND, None)
        try:
            await adapters.load(body.lora_name, body.lora_path, served.names)
        except AdapterError as exc:
            raise bad_request(str(exc), "lora_name" if exc.status == 400 else None) from exc
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=Response,
              responses={**_TEXT_200, **error_responses(400, 401, 404, 413, 500)})
    async def unload_lora_adapter(body: UnloadLoRABody) -> PlainTextResponse:
        if adapters.pool is None:
            raise bad_request("this router's backend serves no LoRA adapters")
        try:
            await adapters.unload(body.lora_name)
        except AdapterError as exc:
            raise APIError(exc.status, str(exc), NOT_FOUND if exc.status == 404 else "invalid_request_error",
                           "lora_name") from exc
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
