"""Reading a config.json's fields with errors that name them (shared by the family parsers)."""

from __future__ import annotations

from typing import Any


def require(cfg: dict, key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"config.json is missing required field '{key}'")
    return cfg[key]


def positive_int(cfg: dict, key: str) -> int:
    value = require(cfg, key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config.json field '{key}' must be a positive integer, got {value!r}")
    return value
