"""Operator routes: GET /admin/nodes, POST /admin/scale, POST /admin/switch.

They answer only when the backend can scale (a cluster backend with a Scaler), and sit behind the
same API key as /v1/* (AdmissionMiddleware). They are left out of the OpenAPI document: they are
not part of the OpenAI contract, and a fuzzer following the document must not resize the cluster.
`pdserve scale` is their command-line client.
"""
from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from pdserve.router.openai.errors import APIError, bad_request
from pdserve.router.scaling.planner_loop import PlannerLoop
from pdserve.router.scaling.scaler import ScaleError, Scaler


class ScaleBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefill: int | None = Field(default=None, ge=0, le=1024)
    decode: int | None = Field(default=None, ge=1, le=1024)
    wait: bool = True  # answer once new nodes have joined (removed ones always drain first)
    # Seconds decode streams may go on on a draining node before they resume elsewhere.
    grace_s: float | None = Field(default=None, ge=0, le=3600)
    remove: list[str] = Field(default=[], max_length=1024)  # nodes to remove first when scaling down


class SwitchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    node_id: str = Field(min_length=1, max_length=256)
    to_role: Literal["prefill", "decode"]
    grace_s: float | None = Field(default=None, ge=0, le=3600)


def _scaler(scaler: Scaler | None) -> Scaler:
    if scaler is None:
        raise APIError(404, "this router's backend cannot be scaled", "not_found_error")
    return scaler


def add_admin_routes(app: FastAPI, scaler: Scaler | None, planner: PlannerLoop | None = None) -> None:
    """scaler: None for a backend that cannot be scaled (every route answers 404); planner: the
    SLA planner loop, when --planner sla."""
    @app.get("/admin/nodes", include_in_schema=False)
    async def admin_nodes() -> dict[str, Any]:
        return {**_scaler(scaler).describe(), "owned": await _run(_scaler(scaler).owned()),
                "planner": planner.recent() if planner is not None else None}

    @app.post("/admin/scale", include_in_schema=False)
    async def admin_scale(body: ScaleBody) -> dict[str, Any]:
        if body.prefill is None and body.decode is None:
            raise bad_request("give prefill, decode or both")
        targets = {"prefill": body.prefill, "decode": body.decode}
        return await _run(_scaler(scaler).scale(targets, body.wait, body.grace_s, tuple(body.remove)))

    @app.post("/admin/switch", include_in_schema=False)
    async def admin_switch(body: SwitchBody) -> dict[str, Any]:
        return await _run(_scaler(scaler).switch(body.node_id, body.to_role, body.grace_s))


async def _run(action):
    try:
        return await action
    except ScaleError as exc:
        raise bad_request(str(exc)) from exc
