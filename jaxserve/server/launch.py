"""Running the server: a model loader with progress bars, and uvicorn with a graceful SIGTERM.

On SIGTERM/SIGINT the server first enters draining (503 for new requests), then uvicorn stops
accepting connections and waits up to `shutdown_timeout` seconds for in-flight responses; those
still running after that are cancelled (which aborts their engine requests), the lifespan stops the
engine thread, and `serve` returns 0. Unlike uvicorn's default, the signal is not re-raised after
the shutdown, so a clean SIGTERM exit has exit code 0.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from tqdm import tqdm

from jaxserve.config import EngineConfig
from jaxserve.server.app import build_app
from jaxserve.server.state import Loader, ServerConfig, ServerState

logger = logging.getLogger("jaxserve.server")


def model_loader(model: str | None, engine_cfg: EngineConfig, show_progress: bool = True) -> Loader:
    """A Loader: resolve + load weights and tokenizer (one bar), then compile every bucket (a bar
    with one tick per program)."""

    def load() -> tuple[Any, Any, Path]:
        from jaxserve.llm import load_engine_core

        name = model or "jaxserve-tiny (embedded default)"
        with tqdm(total=1, desc=f"loading {name}", file=sys.stderr, disable=not show_progress) as bar:
            core, tokenizer, model_dir = load_engine_core(model, engine_cfg, warmup=False)
            bar.update(1)
        compile_bar: tqdm | None = None

        def progress(done: int, total: int, what: str) -> None:
            nonlocal compile_bar
            if compile_bar is None:
                compile_bar = tqdm(total=total, desc="compiling", unit="program", file=sys.stderr,
                                   disable=not show_progress)
            compile_bar.set_postfix_str(what, refresh=False)
            compile_bar.update(done - compile_bar.n)

        try:
            core.runner.warmup(progress)
        finally:
            if compile_bar is not None:
                compile_bar.close()
        return core, tokenizer, model_dir

    return load


def ready_line(state: ServerState, url: str) -> str:
    core = state.core
    cfg = core.engine_cfg
    return (f"jaxserve ready at {url} | model {state.config.served_model_names[0]} ({state.model_dir}) | "
            f"{core.num_kv_pages} KV pages x {cfg.page_size} tokens | max_model_len {cfg.max_model_len} | "
            f"buckets: tokens {list(cfg.resolved_token_buckets())} x seqs {list(cfg.resolved_seq_buckets())} | "
            f"started in {state.load_seconds:.1f}s")


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains the app on a signal and does not re-raise the signal afterwards."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.app_state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.app_state.begin_drain()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl+C: stop waiting
        else:
            self.should_exit = True

    def url(self) -> str:
        cfg = self.config
        port = cfg.port
        if self.started and self.servers and self.servers[0].sockets:
            port = self.servers[0].sockets[0].getsockname()[1]
        return f"http://{cfg.host}:{port}"


def serve(model: str | None, engine_cfg: EngineConfig, server_cfg: ServerConfig, host: str = "127.0.0.1",
          port: int = 8000, shutdown_timeout: float = 30.0, log_level: str = "info", access_log: bool = True,
          show_progress: bool = True) -> int:
    """Serves until SIGTERM/SIGINT; returns the process exit code (1 if the model failed to load)."""
    holder: dict[str, GracefulServer] = {}
    failed: list[BaseException] = []

    def on_ready(state: ServerState) -> None:
        server = holder.get("server")
        url = server.url() if server is not None else f"http://{host}:{port}"
        logger.info(ready_line(state, url))

    def on_failed(error: BaseException) -> None:
        failed.append(error)
        if "server" in holder:
            holder["server"].should_exit = True

    cfg = dataclasses.replace(server_cfg, on_ready=on_ready, on_load_failed=on_failed)
    app = build_app(model_loader(model, engine_cfg, show_progress), cfg)
    uv_cfg = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout, access_log=access_log)
    server = GracefulServer(uv_cfg, app.state.server)
    holder["server"] = server
    server.run()
    if failed:
        logger.error("exiting: the model failed to load: %s", failed[0])
        return 1
    return 0
