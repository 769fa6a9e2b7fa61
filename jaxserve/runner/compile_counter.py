"""Counts XLA backend compiles (jax's monitoring event), so warm-up can prove that every declared
program compiled and a step after it can prove that nothing did: no compile on the request path.

Counts are per thread: jax compiles on the thread that asks, so the serving thread's count moves
only with its own compiles, never with the programs a background thread compiles meanwhile
(runner/background_compile.py)."""

from __future__ import annotations

import threading
from typing import Any

import jax

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts XLA backend compilations per thread (jax.monitoring has no unregister, so one
    listener is installed once and runners read deltas of their own thread's count)."""

    _lock = threading.Lock()
    _installed = False
    _local = threading.local()

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if not cls._installed:
                def on_event(event: str, duration: float, **kwargs: Any) -> None:
                    if event == _COMPILE_EVENT:
                        cls._local.count = getattr(cls._local, "count", 0) + 1
                jax.monitoring.register_event_duration_secs_listener(on_event)
                cls._installed = True

    @classmethod
    def count(cls) -> int:
        """Compilations this thread has run."""
        return getattr(cls._local, "count", 0)
