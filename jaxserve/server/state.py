"""Server configuration and lifecycle: loading (in a background thread) -> ready -> draining.

The model loads and warms up on a thread started by the app's lifespan, so the HTTP server is up
(answering /health with 503) while XLA compiles. A SIGTERM (or the lifespan's shutdown) moves the
state to draining: the server keeps listening, new generation requests get 503, and `in_flight`
(counted by the app) tells launch.py when the requests already running have finished; then uvicorn
stops and the lifespan stops the engine thread.

Host side: jax is imported only by the loader thread (through the Engine), never by this module.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from jaxserve.server.errors import unavailable
from jaxserve.server.reasoning import get_reasoning_parser
from jaxserve.server.tools import DEFAULT_TOOL_PARSER, TOOL_PARSERS, get_tool_parser
from jaxserve.server.tools.tags import ToolTags
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.protocol import ModelContext
from jaxserve.server.responses import TokenStrings
from jaxserve.server.responses_store import ResponseStore

if TYPE_CHECKING:
    from jaxserve.engine.async_engine import Engine

logger = logging.getLogger("jaxserve.server")

# () -> (EngineCore warmed up, Tokenizer, model directory)
Loader = Callable[[], tuple[Any, Any, Path]]
# llguidance's view of the vocabulary (~1 s holding the GIL for a 150k vocabulary) is built once the
# server has been ready and without requests for this long: not during the load, where it delays
# /health by as much, nor beside the first requests. A structured request before then builds it.
GRAMMAR_IDLE_SECONDS = 1.0


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...] = ("jaxserve-tiny",)
    api_key: str | None = None                 # when set, /v1/* needs "Authorization: Bearer <key>"
    max_waiting_requests: int | None = None    # None: the engine config's max_waiting_requests
    request_timeout: float | None = None       # seconds from arrival; the request is aborted after it
    max_request_bytes: int = 16 * 1024 ** 2
    reasoning_parser: str | None = None        # server/reasoning/ registry name
    tool_call_parser: str | None = None        # server/tools/ registry name (forced calls default to hermes)
    enable_auto_tool_choice: bool = False
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    vllm_metric_names: bool = False            # /metrics also under vLLM's names (gateway endpoint pickers)
    kv_transport: str = "http"                 # PD decode instance: how it fetches pages ("http" | "jax")
    kv_transfer_host: str = "127.0.0.1"        # PD: where this instance's jax.experimental.transfer server listens
    chat_template: str | None = None           # Jinja; None: the model's own (tokenizer_config.json)
    generation_config: str = "auto"            # sampling defaults: auto | vllm | a directory (text/generation_config.py)
    enable_response_store: bool = False        # /v1/responses: keep store=true responses in memory (responses_store.py)
    on_ready: Callable[["ServerState"], None] | None = None          # called on the loader thread
    on_load_failed: Callable[[BaseException], None] | None = None   # called on the loader thread

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(isinstance(n, str) and n for n in self.served_model_names):
            raise ValueError("served_model_names must hold at least one non-empty name")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when set")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (known: "
                             f"{', '.join(sorted(TOOL_PARSERS))})")
        if self.kv_transport not in ("http", "jax"):
            raise ValueError(f"--kv-transport must be http or jax, got {self.kv_transport!r}")
        self.parsers()  # unknown names fail at start-up

    def parsers(self) -> tuple[type | None, type]:
        """(reasoning parser class or None, tool parser class)."""
        reasoning = get_reasoning_parser(self.reasoning_parser) if self.reasoning_parser else None
        return reasoning, get_tool_parser(self.tool_call_parser or DEFAULT_TOOL_PARSER)


class ServerState:
    def __init__(self, loader: Loader, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.loader = loader
        self.config = config
        self.metrics = metrics
        self.status = "loading"        # loading | ready | draining | failed
        self.error: BaseException | None = None
        self.engine: Engine | None = None
        self.core: Any = None
        self.tokenizer: Any = None
        self.model_dir: Path | None = None
        self.model: ModelContext | None = None
        self.strings: TokenStrings | None = None
        self.load_seconds = 0.0
        self.in_flight = 0             # HTTP requests running now (app.py counts them, on the event loop)
        self._loader: threading.Thread | None = None
        self.tokenize_lock = threading.Lock()
        self._grammars: Any = None
        self._grammars_lock = threading.Lock()
        self._building_grammars = False
        # /v1/responses' store: None (store=true and previous_response_id refused) unless the flag is on
        self.responses = ResponseStore() if config.enable_response_store else None

    # -------------------------------------------------------------- lifecycle

    def start_loading(self) -> None:
        self._loader = threading.Thread(target=self._load, name="jaxserve-loader", daemon=True)
        self._loader.start()

    @property
    def native_work_running(self) -> bool:
        """A background thread still runs native code that cannot be interrupted: the model's load
        and warm-up (XLA), or llguidance's view of the vocabulary being built."""
        return (self._loader is not None and self._loader.is_alive()) or self._building_grammars

    def _sampling_defaults(self, model_dir: Path) -> dict[str, Any]:
        from jaxserve.text.generation_config import sampling_defaults

        defaults = sampling_defaults(model_dir, self.config.generation_config)
        if defaults:
            logger.info("requests that leave them out sample with the generation config's %s (--generation-config "
                        "vllm: OpenAI's defaults)", ", ".join(f"{k}={v}" for k, v in defaults.items()))
        return defaults

    def _load(self) -> None:
        start = time.monotonic()
        try:
            from jaxserve.engine.async_engine import Engine

            core, tokenizer, model_dir = self.loader()
            if self.config.chat_template is not None:
                tokenizer = tokenizer.with_chat_template(self.config.chat_template)
            if self.status != "loading":  # shut down while we were loading
                return
            engine = Engine(core)
            self.metrics.attach(core)
            engine.on_step = self.metrics.on_step
            engine.start()
            self.core, self.tokenizer, self.model_dir, self.engine = core, tokenizer, model_dir, engine
            reasoning, tools = self.config.parsers()
            self.model = ModelContext(self.config.served_model_names, core.engine_cfg.max_model_len,
                                      core.model_cfg.vocab_size, tokenizer, reasoning, tools,
                                      ToolTags.of(tools.tags, tokenizer), self.config.enable_auto_tool_choice,
                                      core.lora_names, self._sampling_defaults(model_dir))
            self.strings = TokenStrings(lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
                                        tokenizer.convert_ids_to_tokens)
            self.load_seconds = time.monotonic() - start
            threading.Thread(target=self._build_grammars_when_idle, name="jaxserve-grammars", daemon=True).start()
        except BaseException as e:
            self.error = e
            self.status = "failed"
            if isinstance(e, (ValueError, FileNotFoundError)):  # a wrong --model or model files: one line
                logger.error("loading the model failed: %s", e)
                logger.debug("traceback of the load failure", exc_info=e)
            else:
                logger.exception("loading the model failed")
            if self.config.on_load_failed is not None:
                self.config.on_load_failed(e)
            return
        if self.config.on_ready is not None:
            self.config.on_ready(self)  # the "ready" log line comes before /health says so
        self.status = "ready"

    def begin_drain(self, timeout: float | None = None) -> None:
        """New requests get 503 from now on; `timeout`: how long the running ones may still take."""
        if self.status in ("loading", "ready"):
            self.status = "draining"
            within = (f" within {timeout:g}s (--shutdown-timeout), then are aborted; Ctrl+C again stops now"
                      if timeout is not None and self.in_flight else "")
            logger.info("draining: new requests get 503, %d in-flight requests may finish%s", self.in_flight, within)

    async def shutdown(self) -> None:
        self.begin_drain()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)

    # -------------------------------------------------------------- per request

    @property
    def grammars(self) -> Any:
        """The GrammarCompiler (structured output, forced tool calls), built on first use unless
        _build_grammars_when_idle did it before; blocks while it is built (never on the event loop)."""
        with self._grammars_lock:
            if self._grammars is None:
                from jaxserve.structured.compiler import GrammarCompiler

                self._building_grammars = True
                try:
                    self._grammars = GrammarCompiler(self.tokenizer.hf, self.core.model_cfg.vocab_size,
                                                     self.tokenizer.eos_token_ids)
                finally:
                    self._building_grammars = False
            return self._grammars

    def _build_grammars_when_idle(self, poll: float = 0.05) -> None:
        quiet_since = time.monotonic()
        while self._grammars is None and self.status in ("loading", "ready"):
            if self.status != "ready" or self.in_flight:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= GRAMMAR_IDLE_SECONDS:
                self.grammars
                return
            time.sleep(poll)

    @property
    def max_waiting(self) -> int:
        if self.config.max_waiting_requests is not None:
            return self.config.max_waiting_requests
        return self.core.engine_cfg.max_waiting_requests

    def require_ready(self) -> Engine:
        """The engine, or APIError(503) while loading, draining, or after a failure."""
        if self.status == "loading":
            raise unavailable("the model is still loading (warm-up in progress); retry shortly", "model_loading")
        if self.status == "draining":
            raise unavailable("the server is shutting down", "shutting_down")
        if self.status == "failed" or self.engine is None:
            raise unavailable(f"the model failed to load: {self.error}", "model_load_failed")
        if self.engine.error is not None:
            raise unavailable(f"the engine stopped after an error: {self.engine.error}", "engine_failed")
        return self.engine
