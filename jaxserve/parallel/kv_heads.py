"""How many times each KV head is repeated for a tensor-parallel width, and the model config that
results: decided from the config and the layout's rules alone, so the layouts, the planner and the
runner agree (model/kv_heads.py repeats the weights; its docstring says why)."""

from __future__ import annotations

import dataclasses

from jaxserve.core.config import ModelConfig
from jaxserve.parallel import sharding


def kv_duplication(cfg: ModelConfig, model_axis: int, rules: sharding.Rules = sharding.DEFAULT_RULES) -> int:
    """How many times each KV head is repeated for a model axis of this size (1 = not at all):
    when the rules split KV heads over the model axis, the axis exceeds the KV head count and is a
    multiple of it, and the query heads split over it."""
    if dict(rules).get("kv_heads") != sharding.MODEL_AXIS or model_axis <= cfg.num_kv_heads:
        return 1
    if model_axis % cfg.num_kv_heads or cfg.num_heads % model_axis:
        return 1
    return model_axis // cfg.num_kv_heads


def duplicated_config(cfg: ModelConfig, factor: int) -> ModelConfig:
    return cfg if factor == 1 else dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * factor)
