"""Counts XLA backend compiles in this process (jax's monitoring event), so warm-up can prove that
every declared program compiled and a step after it can prove that nothing did: no compile on the
request path."""

from __future__ import annotations

import threading
from typing import Any

import jax

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts XLA backend compilations process-wide (jax.monitoring has no unregister, so one
    listener is installed once and runners read deltas)."""

    _lock = threading.Lock()
    _count = 0
    _installed = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if not cls._installed:
                def on_event(event: str, duration: float, **kwargs: Any) -> None:
                    if event == _COMPILE_EVENT:
                        with cls._lock:
                            cls._count += 1
                jax.monitoring.register_event_duration_secs_listener(on_event)
                cls._installed = True

    @classmethod
    def count(cls) -> int:
        return cls._count
