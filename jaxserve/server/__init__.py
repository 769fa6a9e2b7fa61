"""OpenAI-compatible HTTP server: `build_app(loader, ServerConfig)` and `serve(...)` (see launch.py)."""

from jaxserve.server.app import build_app
from jaxserve.server.state import ServerConfig, ServerState

__all__ = ["ServerConfig", "ServerState", "build_app"]
