"""Running the server: a model loader with progress bars, and uvicorn with a graceful SIGTERM.

On SIGTERM/SIGINT the server enters draining but keeps listening: new generation requests get a
503 (code shutting_down) instead of "connection refused", while the requests already in flight run
on for up to `shutdown_timeout` seconds. Once none is left (or the time is up) uvicorn stops: it
closes the listener, cancels what still runs (which aborts those engine requests), the lifespan
stops the engine thread, and `serve` returns 0. A second Ctrl+C stops at once. Unlike uvicorn's
default, the signal is not re-raised after the shutdown, so a clean SIGTERM exit has exit code 0.
A signal while the model still loads or warms up ends the process as soon as uvicorn has stopped
(exit code 0; the warm-up's compiles are not waited for).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from jaxserve.core.config import EngineConfig
from jaxserve.default_model import DISPLAY_NAME
from jaxserve.core.quiet import quiet_startup
from jaxserve.server.app import build_app
from jaxserve.server.state import Loader, ServerConfig, ServerState

logger = logging.getLogger("jaxserve.server")

# After the drain: how long uvicorn waits for responses still open before cancelling them. The
# drain itself (up to shutdown_timeout) already waited for every request that could finish.
FINAL_GRACE_SECONDS = 1.0
# At the shutdown timeout the requests still running are aborted: this long for their streams to
# send the final event (finish_reason "abort") and [DONE] before uvicorn closes what is left.
ABORT_GRACE_SECONDS = 5.0


def model_loader(model: str | None, engine_cfg: EngineConfig, show_progress: bool = True,
                 followers: Any = None) -> Loader:
    """A Loader: the model loads and every bucket compiles, with progress bars (engine/loading.load_with_progress).
    followers: a multi-host leader's multihost.Followers; they build the engine with the leader's
    resolved sizes and warm up alongside it, then follow its steps."""

    def load() -> tuple[Any, Any, Path]:
        quiet_startup()  # before transformers is imported and jax picks its backend
        from jaxserve.engine.loading import load_with_progress

        if followers is None:
            return load_with_progress(model, engine_cfg, show_progress)
        loaded = load_with_progress(model, engine_cfg, show_progress,
                                    before_warmup=lambda core: followers.send(("config", core.engine_cfg)))
        loaded[0].runner.followers = followers
        return loaded

    return load


def ready_line(state: ServerState, url: str) -> str:
    core = state.core
    cfg = core.engine_cfg
    return (f"jaxserve ready at {url} | model {state.config.served_model_names[0]} ({state.model_dir}) | "
            f"{core.num_kv_pages} KV pages x {cfg.page_size} tokens | max_model_len {cfg.max_model_len} | "
            f"buckets: tokens {list(cfg.resolved_token_buckets())} x seqs {list(cfg.resolved_seq_buckets())} | "
            f"started in {state.load_seconds:.1f}s")


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains the app on a signal while still answering (503 to new requests),
    stops once the in-flight requests are done or `drain_timeout` has passed, and does not
    re-raise the signal afterwards."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float, model: str) -> None:
        super().__init__(config)
        self.app_state = state
        self.drain_timeout = drain_timeout
        self.model = model                         # what is loading, for the "listening" line
        self.drain_deadline: float | None = None   # monotonic; set by the first signal
        self.aborted_at: float | None = None       # monotonic; when the timeout aborted what still ran

    async def startup(self, sockets: list[Any] | None = None) -> None:
        """Binds, then says so in our words (quiet.py drops uvicorn's "Uvicorn running on" line,
        which reads as ready while the model may load for minutes)."""
        await super().startup(sockets)
        if self.started and self.app_state.status == "loading":
            logger.info("jaxserve listening on %s; loading %s (/health answers 503 until ready)", self.url(),
                        self.model)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.drain_timeout
            self.app_state.begin_drain(self.drain_timeout)
        elif sig == signal.SIGINT:  # a second Ctrl+C: stop without waiting
            logger.info("stopping now")
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        """Called by uvicorn's main loop every 0.1 s; True stops the server."""
        if await super().on_tick(counter):
            return True
        if self.drain_deadline is None:
            return False
        if self.app_state.in_flight == 0:
            return True
        now = time.monotonic()
        if self.aborted_at is None and now >= self.drain_deadline:
            engine = self.app_state.engine
            logger.warning("shutdown timeout of %gs reached: aborting %d in-flight requests (their streams end with "
                           "finish_reason \"abort\")", self.drain_timeout, self.app_state.in_flight)
            if engine is not None:
                engine.abort_all()
            self.aborted_at = now
        return self.aborted_at is not None and now >= self.aborted_at + ABORT_GRACE_SECONDS

    def url(self) -> str:
        cfg = self.config
        port = cfg.port
        if self.started and self.servers and self.servers[0].sockets:
            port = self.servers[0].sockets[0].getsockname()[1]
        return f"http://{cfg.host}:{port}"


def serve(model: str | None, engine_cfg: EngineConfig, server_cfg: ServerConfig, host: str = "127.0.0.1",
          port: int = 8000, shutdown_timeout: float = 30.0, log_level: str = "info", access_log: bool = True,
          show_progress: bool = True, multi: Any = None) -> int:
    """Serves until SIGTERM/SIGINT; returns the process exit code (1 if the model failed to load).
    multi: a multihost.MultiHost when this is rank 0 of several processes (it waits for the others
    to connect first, and tells them to stop when it stops)."""
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

    quiet_startup()
    followers = None
    if multi is not None:
        from jaxserve.distributed.multihost import Followers

        followers = Followers(multi)
    cfg = dataclasses.replace(server_cfg, on_ready=on_ready, on_load_failed=on_failed)
    app = build_app(model_loader(model, engine_cfg, show_progress, followers), cfg)
    # log_config=None: uvicorn's loggers keep no handlers of their own and propagate to the root
    # one (cli.py's format, and tqdm's redirect while the bars show); log_level still sets theirs.
    uv_cfg = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", log_config=None,
                            timeout_graceful_shutdown=FINAL_GRACE_SECONDS, access_log=access_log)
    server = GracefulServer(uv_cfg, app.state.server, shutdown_timeout, model or DISPLAY_NAME)
    holder["server"] = server
    try:
        server.run()
    finally:
        if followers is not None:
            followers.close()
    code = 1 if failed else 0  # the loader thread has logged why
    if app.state.server.native_work_running:
        # Stopped during the load or warm-up (or llguidance's start-up right after it): that thread
        # is inside native code and cannot be interrupted, and an interpreter exit around it aborts
        # the process (SIGABRT, "FATAL: exception not rethrown") when the thread returns into
        # Python. Nothing is left to save.
        logger.info("stopped before the start-up finished: exiting without waiting for it")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
