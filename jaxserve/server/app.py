"""The Starlette app: OpenAI routes (completions, chat, responses), vLLM's /tokenize, /detokenize
and /version, /health, /metrics; auth, body limits, admission control.

Order of checks for a generation request: API key (401) -> ready (503) -> content type and body
size (400/413) -> JSON and fields (400) -> waiting queue (429) -> submit. Every failure is an
OpenAI-shaped error; an unexpected exception is logged and answered with a 500-shaped error.
Every HTTP request is counted while it runs (streams until their last event), so a drain after
SIGTERM knows when the in-flight work is done, and once answered, by endpoint and status code.
"""

from __future__ import annotations

import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.server import generation, kv_routes, lora_admin, responses_stream, tokenize_routes
from jaxserve.server.errors import APIError, bad_request, internal, overloaded, too_large, unauthorized
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.grammars import request_grammar
from jaxserve.server.protocol import GenerationRequest, parse_completion, parse_json_body
from jaxserve.server.chat_request import parse_chat
from jaxserve.server.responses_api import STORE_FLAG, parse_responses
from jaxserve.server.state import Loader, ServerConfig, ServerState

logger = logging.getLogger("jaxserve.server")

Handler = Callable[[Request], Awaitable[Response]]


def build_app(loader: Loader, config: ServerConfig) -> Starlette:
    """An app that loads the model with `loader` on a background thread once it starts serving."""
    state = ServerState(loader, config, ServerMetrics(config.served_model_names[0], config.vllm_metric_names))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.start_loading()
        try:
            yield
        finally:
            await state.shutdown()

    def guarded(handler: Handler, auth: bool) -> Handler:
        async def wrapper(request: Request) -> Response:
            try:
                if auth:
                    _check_auth(request, config.api_key)
                return await handler(request)
            except APIError as e:
                if e.status == 500:  # a server fault the client cannot fix: keep its cause
                    logger.error("%s %s: %s", request.method, request.url.path, e.message, exc_info=e.__cause__)
                return e.response()
            except ClientDisconnect:
                return APIError(499, "client disconnected while sending the request").response()
            except Exception:
                logger.exception("unexpected error handling %s %s", request.method, request.url.path)
                return internal().response()
        return wrapper

    async def completions(request: Request) -> Response:
        return await _generate(state, request, parse_completion)

    async def chat(request: Request) -> Response:
        return await _generate(state, request, parse_chat)

    async def create_response(request: Request) -> Response:
        arrival = time.monotonic()
        state.require_ready()
        body = parse_json_body(await _read_body(request, config.max_request_bytes))
        rr = await run_in_threadpool(_locked, state, lambda b, ctx: parse_responses(b, ctx, state.responses), body)
        # the response has an id of its own; a PD decode instance does not import pages for it (yet)
        _, runs = await _submit(state, rr.gen, None, arrival)
        answer = responses_stream.respond(state, rr, runs, request)
        return answer if rr.gen.stream else await answer

    async def stored_response(request: Request) -> Response:
        if state.responses is None:
            raise bad_request(f"responses are not stored on this server (start it with {STORE_FLAG})")
        rid = request.path_params["response_id"]
        if request.method == "DELETE":
            if not state.responses.delete(rid):
                raise _no_response(rid)
            return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})
        found = state.responses.get(rid)
        if found is None:
            raise _no_response(rid)
        return JSONResponse(found.response)

    async def models(request: Request) -> Response:
        max_len = state.core.engine_cfg.max_model_len if state.core is not None else None
        data = [{"id": name, "object": "model", "created": int(time.time()), "owned_by": "jaxserve",
                 "root": str(state.model_dir) if state.model_dir else None, "max_model_len": max_len}
                for name in config.served_model_names]
        if state.core is not None:  # LoRA adapters, as vLLM lists them: parent = the base model
            data += [{"id": name, "object": "model", "created": int(time.time()), "owned_by": "jaxserve",
                      "root": path, "parent": config.served_model_names[0], "max_model_len": max_len}
                     for name, path in state.core.lora_modules.items()]
        return JSONResponse({"object": "list", "data": data})

    async def load_lora(request: Request) -> Response:
        return await lora_admin.load(state, request, await _read_body(request, config.max_request_bytes))

    async def unload_lora(request: Request) -> Response:
        return await lora_admin.unload(state, request, await _read_body(request, config.max_request_bytes))

    async def health(request: Request) -> Response:
        engine = state.engine
        if state.status == "ready" and engine is not None and engine.error is None:
            runner = state.core.runner  # serving while the rest compiles in the background: how far
            return JSONResponse({"status": "ok", "programs_compiled": runner.programs_compiled,
                                 "programs_declared": runner.programs_declared})
        detail = {"status": state.status if engine is None or engine.error is None else "engine_failed"}
        if state.error is not None:
            detail["error"] = str(state.error)
        return JSONResponse(detail, status_code=503)

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def kv_export(request: Request) -> Response:
        return await kv_routes.export(state, request)

    async def tokenize(request: Request) -> Response:
        return await _tokenizer_route(state, request, tokenize_routes.tokenize)

    async def detokenize(request: Request) -> Response:
        return await _tokenizer_route(state, request, tokenize_routes.detokenize)

    async def version(request: Request) -> Response:
        return JSONResponse(tokenize_routes.version())

    routes = [
        Route("/v1/completions", guarded(completions, True), methods=["POST"]),
        Route("/v1/kv/export", guarded(kv_export, True), methods=["POST"]),
        Route("/v1/chat/completions", guarded(chat, True), methods=["POST"]),
        Route("/v1/responses", guarded(create_response, True), methods=["POST"]),
        Route("/v1/responses/{response_id}", guarded(stored_response, True), methods=["GET", "DELETE"]),
        Route("/v1/models", guarded(models, True), methods=["GET"]),
        *([Route("/v1/load_lora_adapter", guarded(load_lora, True), methods=["POST"]),
           Route("/v1/unload_lora_adapter", guarded(unload_lora, True), methods=["POST"])]
          if config.allow_runtime_lora_updating else []),
        Route("/tokenize", guarded(tokenize, True), methods=["POST"]),
        Route("/detokenize", guarded(detokenize, True), methods=["POST"]),
        Route("/version", guarded(version, False), methods=["GET"]),
        Route("/health", guarded(health, False), methods=["GET"]),
        Route("/metrics", guarded(metrics, False), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error},
                    middleware=[Middleware(_CountInFlight, state=state, routes=tuple(routes))])
    app.state.server = state
    return app


class _CountInFlight:
    """ASGI middleware: `state.in_flight` counts HTTP requests from arrival until the last byte of
    their response (the ASGI call of a streamed response returns after its last event), and the
    metrics count every answered request by endpoint (the app's routes, by their path template:
    "/v1/responses/{response_id}"; any other path is "other", so a scan of unknown paths adds no
    series) and status code."""

    def __init__(self, app: ASGIApp, state: ServerState, routes: tuple[Route, ...]) -> None:
        self.app = app
        self.state = state
        self.routes = routes

    def endpoint(self, path: str) -> str:
        return next((route.path for route in self.routes if route.path_regex.match(path)), "other")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # no response started: the server failed

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send_status)
        finally:
            self.state.in_flight -= 1
            self.state.metrics.http_request(self.endpoint(scope["path"]), status)


async def _generate(state: ServerState, request: Request, parse: Callable[..., Any]) -> Response:
    arrival = time.monotonic()
    state.require_ready()
    body = parse_json_body(await _read_body(request, state.config.max_request_bytes))
    remote = kv_routes.remote_of(state, body)  # PD: a decode instance imports the prompt's pages first
    # Tokenization / chat templates can take milliseconds for long prompts: off the event loop, one
    # at a time (a HF fast tokenizer may raise "Already borrowed" under concurrent use).
    gen = await run_in_threadpool(_locked, state, parse, body)
    resp, runs = await _submit(state, gen, remote, arrival)
    if gen.stream:
        return generation.stream(state, gen, resp, runs)
    return await generation.complete(state, gen, resp, runs, request)


async def _submit(state: ServerState, gen: GenerationRequest, remote: str | None,
                  arrival: float) -> tuple[Any, list]:
    """A parsed request's grammar compiled, admission checked, the prompt's pages imported from
    `remote` (PD), engine requests submitted: (the response's identity, its RequestRuns)."""
    engine = state.require_ready()
    if gen.params.structured_outputs is not None or gen.forces_tool_calls:
        # state.grammars may still be building (or not built yet): waited for off the event loop
        gen.grammar = await run_in_threadpool(lambda: request_grammar(state.grammars, gen, state.model))
    new_sequences = len(gen.prompts) * gen.params.n
    if new_sequences > state.max_waiting:
        raise bad_request(f"this request needs {new_sequences} sequences (prompts x n); at most "
                          f"{state.max_waiting} may wait at once", "n")
    if engine.num_waiting + new_sequences > state.max_waiting:
        raise overloaded(state.max_waiting)
    if remote is not None:
        await kv_routes.import_prompts(state, remote, gen.prompts, gen.cache_salt)
    return generation.submit(state, gen, arrival)


def _no_response(rid: str) -> APIError:
    return APIError(404, f"response {rid!r} was not found: it was never stored or the store evicted it",
                    "invalid_request_error", "response_id", "not_found")


async def _tokenizer_route(state: ServerState, request: Request,
                           handle: Callable[[dict, Any], dict]) -> Response:
    """/tokenize and /detokenize: the body through `handle` with the tokenizer, off the event loop."""
    state.require_ready()
    body = parse_json_body(await _read_body(request, state.config.max_request_bytes))
    return JSONResponse(await run_in_threadpool(_locked, state, handle, body))


def _locked(state: ServerState, parse: Callable[..., Any], body: dict) -> Any:
    with state.tokenize_lock:
        return parse(body, state.model)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, read with a cap (Content-Length is checked first but not trusted)."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";", 1)[0].strip().lower() != "application/json":
        raise bad_request(f"Content-Type must be application/json, got {ctype or 'nothing'!r}")
    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise bad_request(f"invalid Content-Length header {length!r}")
        if int(length) > limit:
            raise too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(limit)
    return bytes(body)


def _check_auth(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise unauthorized()


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 in OpenAI's error shape."""
    status = getattr(exc, "status_code", 500)
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    return APIError(status, str(getattr(exc, "detail", exc)), "invalid_request_error", None, code).response(
        headers=getattr(exc, "headers", None))
