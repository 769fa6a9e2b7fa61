"""The router's HTTP front: OpenAI requests forwarded to a replica chosen by routing_policy.py, responses
(SSE streams included) passed through unchanged as they arrive.

Routes: POST /v1/completions, /v1/chat/completions (routed); GET /v1/models, /version, POST
/tokenize, /detokenize (any healthy replica's); GET /health (200 while any replica is healthy); GET /metrics (the router's own
`jaxserve_router:` series, then every replica's metrics with a `replica` label added to each
sample). A replica's /health is polled every HEALTH_INTERVAL seconds; one that fails gets no new
requests until it answers again. A request whose replica cannot be reached gets a 502 naming it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Sequence

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxserve.distributed.routing_policy import RoutingPolicy

logger = logging.getLogger("jaxserve.router")

HEALTH_INTERVAL = 2.0
# Hop-by-hop and length headers are the proxy's own business on each side.
_DROPPED_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host"}


def error(status: int, message: str, code: str, type_: str = "bad_gateway") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "code": code}}, status)


def json_body(raw: bytes) -> dict | JSONResponse:
    """The request's JSON object, or the 400 to answer."""
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("not an object")
        return body
    except ValueError as e:
        return error(400, f"request body is not a JSON object: {e}", "invalid_json", "invalid_request_error")


async def relay(client: httpx.AsyncClient, request: Request, url: str, content: bytes, what: str,
                done: Callable[[], None] = lambda: None) -> Response:
    """Sends `content` to `url` (the request's method, headers and query) and streams the answer
    back as it arrives; done() runs when it has ended, also when the client went away first
    (closing the upstream response aborts the request there). 502 naming `what` when unreachable."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED_HEADERS}
    upstream = client.build_request(request.method, url, content=content, headers=headers,
                                    params=request.query_params)
    try:
        response = await client.send(upstream, stream=True)
    except httpx.HTTPError as e:
        done()
        return error(502, f"{what} cannot be reached: {type(e).__name__}", "upstream_unreachable")

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_bytes():
                yield chunk
        finally:
            await response.aclose()
            done()

    out_headers = {k: v for k, v in response.headers.items() if k.lower() not in _DROPPED_HEADERS}
    return StreamingResponse(chunks(), response.status_code, out_headers)


def client_lifespan(client: dict[str, httpx.AsyncClient], timeout: float | None,
                    background: Callable[[], Any] | None = None) -> Callable[[Starlette], Any]:
    """A Starlette lifespan that opens client["c"] (and runs `background()` as a task) while the app
    serves, and closes them at shutdown."""
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        client["c"] = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        task = asyncio.create_task(background()) if background is not None else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            await client["c"].aclose()
    return lifespan


def routing_key(body: dict) -> str:
    """What a request's prefix-cache affinity is decided on: the prompt, or the chat messages."""
    if "messages" in body:
        return json.dumps(body.get("messages"), ensure_ascii=False, separators=(",", ":"))
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"))


def merge_replica_metrics(texts: Sequence[tuple[int, str]]) -> list[Metric]:
    """The replicas' Prometheus texts as metric families, each sample labelled replica="i": one
    family per name holding every replica's samples (so one HELP/TYPE and its samples together),
    parsed and re-emitted by prometheus_client, so any label value (a `}` or `"` in an adapter
    name) survives. A replica whose text does not parse is left out and logged."""
    families: dict[str, Metric] = {}
    for replica, text in texts:
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError as e:
            logger.warning("replica %d: its /metrics did not parse (%s); left out", replica, e)
            continue
        for fam in parsed:
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            merged.samples += [s._replace(labels={"replica": str(replica), **s.labels}) for s in fam.samples]
    return list(families.values())


class _Families:
    """A collector of fixed families (prometheus_client renders them)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


class _RouterCollector:
    def __init__(self, policy: RoutingPolicy, healthy: list[bool]) -> None:
        self.policy, self.healthy = policy, healthy

    def collect(self):  # noqa: ANN201 (prometheus_client protocol)
        in_flight = GaugeMetricFamily("jaxserve_router:in_flight", "Requests sent to a replica and not finished.",
                                      labels=["replica"])
        routed = CounterMetricFamily("jaxserve_router:routed", "Requests sent to a replica.", labels=["replica"])
        by_prefix = CounterMetricFamily("jaxserve_router:routed_by_prefix",
                                        "Requests sent to the replica holding their longest remembered prefix.",
                                        labels=["replica"])
        healthy = GaugeMetricFamily("jaxserve_router:replica_healthy", "1 while the replica's /health answers 200.",
                                    labels=["replica"])
        for i, load in enumerate(self.policy.loads):
            in_flight.add_metric([str(i)], load.in_flight)
            routed.add_metric([str(i)], load.routed)
            by_prefix.add_metric([str(i)], load.by_prefix)
            healthy.add_metric([str(i)], 1.0 if self.healthy[i] else 0.0)
        return [in_flight, routed, by_prefix, healthy]


def build_router(replicas: list[str], balance_slack: int = 8, balance_ratio: float = 1.5) -> Starlette:
    """replicas: base URLs (http://host:port) of jaxserve (or other OpenAI-compatible) servers."""
    urls = [u.rstrip("/") for u in replicas]
    policy = RoutingPolicy(len(urls), balance_slack, balance_ratio)
    healthy = [False] * len(urls)
    registry = CollectorRegistry()
    registry.register(_RouterCollector(policy, healthy))
    client: dict[str, httpx.AsyncClient] = {}

    async def poll_health() -> None:
        while True:
            for i, url in enumerate(urls):
                try:
                    r = await client["c"].get(f"{url}/health", timeout=5.0)
                    up = r.status_code == 200
                except httpx.HTTPError:
                    up = False
                if up != healthy[i]:
                    logger.info("replica %d (%s) is %s", i, url, "healthy" if up else "not healthy")
                healthy[i] = up
            await asyncio.sleep(HEALTH_INTERVAL)

    lifespan = client_lifespan(client, None, poll_health)

    async def forward(request: Request) -> Response:
        raw = await request.body()
        body = json_body(raw)
        if isinstance(body, JSONResponse):
            return body
        try:
            replica = policy.choose(routing_key(body), healthy)
        except RuntimeError:
            return error(503, "no replica is healthy", "no_replica", "unavailable")
        return await relay(client["c"], request, urls[replica] + request.url.path, raw,
                           f"replica {replica} ({urls[replica]})", lambda: policy.done(replica))

    async def any_replica(request: Request) -> Response:
        """What every replica answers alike (the model list, the tokenizer, the version): the first
        healthy one answers."""
        for i, url in enumerate(urls):
            if healthy[i]:
                return await relay(client["c"], request, url + request.url.path, await request.body(),
                                   f"replica {i} ({url})")
        return error(503, "no replica is healthy", "no_replica", "unavailable")

    async def health(request: Request) -> Response:
        return Response(status_code=200 if any(healthy) else 503)

    async def metrics(request: Request) -> Response:
        texts = []
        for i, url in enumerate(urls):
            try:
                r = await client["c"].get(f"{url}/metrics", timeout=5.0)
            except httpx.HTTPError:
                continue
            texts.append((i, r.text))
        replicas = CollectorRegistry(auto_describe=False)
        replicas.register(_Families(merge_replica_metrics(texts)))
        body = generate_latest(registry) + generate_latest(replicas)
        return Response(body, media_type="text/plain; version=0.0.4")

    app = Starlette(routes=[
        Route("/v1/completions", forward, methods=["POST"]),
        Route("/v1/chat/completions", forward, methods=["POST"]),
        Route("/v1/models", any_replica, methods=["GET"]),
        Route("/tokenize", any_replica, methods=["POST"]),
        Route("/detokenize", any_replica, methods=["POST"]),
        Route("/version", any_replica, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], lifespan=lifespan)
    app.state.policy = policy
    return app
