"""Lifecycle: 503 while warming up, per-request timeouts, and SIGTERM to `jaxserve serve`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from jaxserve.server import ServerConfig, build_app
from server_utils import MODEL, TEST_ENGINE, LiveServer, read_sse, start_server

REPO = Path(__file__).resolve().parents[2]


def test_503_while_the_model_loads_then_200(loaded_model):
    gate = threading.Event()

    def slow_loader():  # the app serves HTTP while this runs on its loader thread
        assert gate.wait(120)
        return loaded_model

    live = LiveServer(build_app(slow_loader, ServerConfig(served_model_names=(MODEL,))))
    try:
        health = httpx.get(f"{live.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = httpx.post(f"{live.url}{path}", json=body if "chat" not in path else
                           {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "model_loading"
        assert httpx.get(f"{live.url}/metrics").status_code == 200
        gate.set()
        live.wait_ready(timeout=30)
        r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        gate.set()
        live.stop()


def test_request_timeout_aborts_and_reports(loaded_model):
    live = start_server(loaded_model, request_timeout=1.0)
    try:
        before = live.wait_idle()
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        start = time.monotonic()
        r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        assert time.monotonic() - start < 10
        with httpx.stream("POST", f"{live.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            assert s.status_code == 200
            events = read_sse(s)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "request_timeout"
        after = live.wait_idle(timeout=30)
        key = "jaxserve:request_success_total{finished_reason=abort}"
        assert after[key] == before[key] + 2
    finally:
        live.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_in_flight_stream_and_exits_0(xla_cache_dir, loaded_model, tmp_path):
    """`jaxserve serve` as a subprocess: /health is 503 during its real warm-up, then 200; a stream
    in flight at SIGTERM completes; the process exits with code 0 within the grace period."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = TEST_ENGINE
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port),
           "--max-model-len", str(cfg["max_model_len"]), "--max-num-seqs", str(cfg["max_num_seqs"]),
           "--max-num-batched-tokens", str(cfg["max_num_batched_tokens"]),
           "--num-kv-pages", str(cfg["num_kv_pages"]), "--page-size", str(cfg["page_size"]),
           "--token-buckets", "64", "--seq-buckets", "16", "--compilation-cache-dir", str(xla_cache_dir),
           "--shutdown-timeout", "30", "--no-progress", "--no-access-log"]
    # Same XLA options as this process, so the warm-up hits the compilation cache written here.
    env = {**os.environ, "JAX_DEFAULT_MATMUL_PRECISION": "highest",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        saw_503 = False
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                status = httpx.get(f"{url}/health", timeout=5).status_code
            except httpx.TransportError:
                status = None
            saw_503 |= status == 503
            if status == 200:
                break
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.1)
        assert saw_503, "never saw /health answer 503 during warm-up"
        assert "jaxserve ready at" in log_path.read_text()

        body = {"model": MODEL, "prompt": "Count with me", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            sent_at = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            try:  # new work is refused: the listener is closed, or it answers 503
                late = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=5)
                assert late.status_code == 503
            except httpx.TransportError:
                pass
            events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in events[-2]  # the in-flight request ran to completion
        assert proc.wait(timeout=60) == 0, log_path.read_text()
        assert time.monotonic() - sent_at < 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
