"""Helpers for server tests: a real uvicorn server on an ephemeral port, SSE parsing, /metrics parsing.

Every test module starts its own app (with its own ServerConfig) around the session's EngineCore
(see conftest.py), so the model load + warm-up happens once per session.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.server import ServerConfig, build_app

MODEL = "jaxserve-tiny"
# One token bucket and one sequence bucket: every step has the same shapes, so a row's greedy
# output cannot depend on what else is in the batch, and warm-up compiles few programs.
TEST_ENGINE = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=64, num_kv_pages=128,
                   page_size=16, token_buckets=(64,), seq_buckets=(16,))


class LiveServer:
    """A real uvicorn server on 127.0.0.1:<ephemeral> running `app` on a background thread."""

    def __init__(self, app: Any, shutdown_timeout: float = 5.0) -> None:
        self.app = app
        self.state = app.state.server
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=shutdown_timeout)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while httpx.get(f"{self.url}/health").status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become ready")
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        """Sample name (plus non-model labels in braces) -> value, e.g.
        'jaxserve:request_success_total{finished_reason=abort}'."""
        text = httpx.get(f"{self.url}/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Polls /metrics until nothing runs or waits and no KV page is held; returns the metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["jaxserve:num_requests_running"] == 0 and m["jaxserve:num_requests_waiting"] == 0
                    and m["jaxserve:num_kv_pages_used"] == 0):
                return m
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not idle: {m}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stops the server; raises if the engine thread died while it ran (which would explain
        every later failure of the module)."""
        self.server.should_exit = True
        self.thread.join(60)
        engine = self.state.engine
        if engine is not None and engine.error is not None:
            raise AssertionError(f"the engine thread failed during this module: {engine.error!r}")


def start_server(loaded_model: tuple[Any, Any, Path], **config: Any) -> LiveServer:
    """A ready server around the session's engine core (config: ServerConfig fields)."""
    app = build_app(lambda: loaded_model, ServerConfig(served_model_names=(MODEL,), **config))
    live = LiveServer(app)
    live.wait_ready()
    return live


def client_for(server: LiveServer) -> openai.OpenAI:
    """The official openai client for a live server (no retries: a failure shows at once)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def read_sse(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of an SSE response: parsed JSON objects, then the literal '[DONE]'."""
    events: list[Any] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
