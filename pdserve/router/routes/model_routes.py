"""What the router serves under which names: GET /v1/models, GET /v1/models/{model}, GET /version.

`--served-model-name NAME [NAME ...]` (vLLM's flag) gives the names: the first is the model's id,
and a request may name any of them in `model`; without the flag the name is `--model` as given.
Each name is listed in /v1/models as its own card (as vLLM lists them), and every card's `root`
is the local directory the router loaded the tokenizer from, so a client on the same machine
(a benchmark's processor, a tokenizer-side tool) can load the same tokenizer.

LoRA adapters (pdserve.router.dispatch.adapters) are served under their own names: each is a card whose
`parent` is the model's id and whose `root` is the adapter's directory, as vLLM lists them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Path

from pdserve import __version__
from pdserve.router.dispatch.adapters import RouterAdapters
from pdserve.router.openai.errors import error_responses, model_not_found


def served_names(flag_values: list[str] | None, model: str) -> list[str]:
    """The names from --served-model-name; each value may hold several, space-separated (a
    compose file's one `${VAR}` can then carry aliases). None given or all blank: `model`."""
    names = [name for value in flag_values or [] for name in value.split()]
    return list(dict.fromkeys(names)) or [model]


@dataclass
class ServedModel:
    names: list[str]  # the first: the model's id
    root: str  # the directory holding the tokenizer (for a GGUF model: its view directory)
    max_model_len: int
    created: int
    adapters: RouterAdapters = field(default_factory=RouterAdapters)

    @property
    def id(self) -> str:
        return self.names[0]

    def resolve(self, requested: str | None) -> str:
        """The name a response carries: the one requested (as vLLM echoes it), by default the
        id. An unknown name is a 404, as in OpenAI's API."""
        if requested is None:
            return self.id
        if requested not in self.names and requested not in self.adapters:
            raise model_not_found(requested)
        return requested

    def adapter_for(self, requested: str | None) -> str | None:
        """The LoRA adapter a request's `model` names; None: the base model."""
        return requested if requested in self.adapters and requested not in self.names else None

    def card(self, name: str) -> dict[str, Any]:
        adapter = self.adapter_for(name)
        return {"id": name, "object": "model", "created": self.created, "owned_by": "pdserve",
                "root": self.adapters.paths[adapter] if adapter else self.root,
                "parent": self.id if adapter else None, "max_model_len": self.max_model_len}

    def all_names(self) -> list[str]:
        return self.names + [a for a in self.adapters.names() if a not in self.names]


def add_model_routes(app: FastAPI, served: ServedModel) -> None:
    @app.get("/v1/models", responses=error_responses(401, 500))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [served.card(name) for name in served.all_names()]}

    # :path, since model names may hold a slash ("org/model"), which the client sends as it is.
    # The example lets a fuzzer following the document reach a 200, not only 404s.
    @app.get("/v1/models/{model:path}", responses=error_responses(401, 404, 500))
    async def retrieve_model(model: str = Path(examples=[served.id])) -> dict[str, Any]:
        return served.card(served.resolve(model))

    @app.get("/version", responses=error_responses(500))  # open, as /health is
    async def version() -> dict[str, str]:
        return {"version": __version__}
