"""Run-time LoRA adapter loading, vLLM's endpoints and bodies (behind --allow-runtime-lora-updating):

    POST /v1/load_lora_adapter   {"lora_name": "sql", "lora_path": "/adapters/sql"}
    POST /v1/unload_lora_adapter {"lora_name": "sql"}

Loading reads and checks the adapter off the event loop (400 naming the problem); unloading waits
for the engine's next step to decide: 400 while sequences of the adapter run or wait, 404 for a name
that is not loaded. The served names (`model` field, /v1/models) follow at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.protocol import parse_json_body
from jaxserve.server.state import ServerState

UNLOAD_TIMEOUT_S = 30.0  # the engine decides at its next step; a step never takes this long


def _name(body: dict[str, Any], field: str = "lora_name") -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{field}' must be a non-empty string", field)
    return value


def _refresh_names(state: ServerState) -> None:
    state.model = dataclasses.replace(state.model, lora_names=state.core.lora_names)


async def load(state: ServerState, request: Request, body_bytes: bytes) -> Response:
    state.require_ready()
    body = parse_json_body(body_bytes)
    name, path = _name(body), _name(body, "lora_path")
    try:
        await run_in_threadpool(state.core.load_lora_adapter, name, path)
    except (ValueError, FileNotFoundError) as e:
        raise bad_request(str(e), "lora_name" if name in state.core.lora_names else "lora_path") from None
    _refresh_names(state)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload(state: ServerState, request: Request, body_bytes: bytes) -> Response:
    state.require_ready()
    name = _name(parse_json_body(body_bytes))
    try:
        await asyncio.wait_for(asyncio.wrap_future(state.core.unload_lora_adapter(name)), UNLOAD_TIMEOUT_S)
    except LookupError as e:
        raise APIError(404, str(e), "NotFoundError", "lora_name", "lora_adapter_not_found") from None
    except ValueError as e:
        raise bad_request(str(e), "lora_name", "lora_adapter_in_use") from None
    _refresh_names(state)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
