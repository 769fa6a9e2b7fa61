"""Sharding layouts as data: how one replica's devices split the model, and how many replicas a
target holds. A layout is a name, the logical-axis rules (sharding.py) and a tensor-parallel size;
the devices of a target that one replica does not use serve more replicas (data parallelism:
independent engines, as `--data-parallel-size` will run them). A new layout is one more entry in
`RULE_SETS`.
"""

from __future__ import annotations

import dataclasses

from jaxserve.parallel import sharding
from jaxserve.core.config import ModelConfig
from jaxserve.parallel.kv_heads import kv_duplication

MODEL = sharding.MODEL_AXIS

# name -> logical-axis rules. "tp" is the serving default (sharding.DEFAULT_RULES).
RULE_SETS: dict[str, tuple[tuple[str, str | None], ...]] = {
    "tp": sharding.DEFAULT_RULES,
    # the embedding/lm_head whole on every device: no vocab all-gather, more weight bytes per device
    "tp-vocab-replicated": tuple((k, None if k == "vocab" else v) for k, v in sharding.DEFAULT_RULES),
    # KV heads whole on every device even when the model axis could split or duplicate them
    "tp-kv-replicated": tuple((k, None if k == "kv_heads" else v) for k, v in sharding.DEFAULT_RULES),
    # MoE: whole experts split over the model axis (expert parallelism) instead of TP inside each
    "tp-ep": tuple((k, {"expert": MODEL, "expert_mlp": None}.get(k, v)) for k, v in sharding.DEFAULT_RULES),
    # MoE, EP x TP on a DATAxMODEL mesh: experts split over `data`, each expert's width over `model`
    # (attention stays tensor-parallel over `model`, repeated on each `data` row)
    "tp-ep-data": tuple((k, {"expert": sharding.DATA_AXIS}.get(k, v)) for k, v in sharding.DEFAULT_RULES),
}


# layouts that put something on the data axis (serving's --mesh DATAxMODEL), not planned
DATA_AXIS_LAYOUTS = frozenset({"tp-ep-data"})


def layout_rules(name: str, cfg: ModelConfig) -> tuple[tuple[str, str | None], ...]:
    """The rules of a serving layout (--layout); the expert-parallel ones need a mixture of experts."""
    if name not in RULE_SETS:
        raise ValueError(f"unknown layout {name!r}; known: {', '.join(RULE_SETS)}")
    if "-ep" in name and cfg.moe is None:
        raise ValueError(f"layout {name!r} splits experts, and {cfg.architecture} has none")
    return RULE_SETS[name]


@dataclasses.dataclass(frozen=True)
class Layout:
    rules_name: str     # a key of RULE_SETS
    tp: int             # devices of one replica (the model axis)
    replicas: int       # data-parallel replicas on the target

    @property
    def rules(self) -> tuple[tuple[str, str | None], ...]:
        return RULE_SETS[self.rules_name]

    @property
    def name(self) -> str:
        return f"{self.rules_name} dp={self.replicas} tp={self.tp}"


def make_layout(rules_name: str, num_devices: int, tp: int | None = None) -> Layout:
    """`tp` devices per replica (default: every device of the target in one replica)."""
    if rules_name not in RULE_SETS:
        raise ValueError(f"unknown layout {rules_name!r}; known: {', '.join(RULE_SETS)}")
    if rules_name in DATA_AXIS_LAYOUTS:
        raise ValueError(f"layout {rules_name!r} splits over the data axis of a DATAxMODEL mesh; planned replicas "
                         "are 1xTP meshes (serve it with --mesh DxT --layout " + rules_name + ")")
    tp = num_devices if tp is None else tp
    if tp < 1 or num_devices % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide the target's {num_devices} devices")
    return Layout(rules_name, tp, num_devices // tp)


def check_divides(layout: Layout, cfg: ModelConfig) -> list[str]:
    """Raises ValueError naming the dimension a layout cannot split; returns notes on the KV heads
    (duplicated to one per device when the TP size is a multiple of their count, else whole on
    every device)."""
    tp = layout.tp
    if tp == 1:
        return []
    rules = dict(layout.rules)
    dims = {"q_heads": ("query heads (num_attention_heads)", cfg.num_heads),
            "mlp": ("MLP width (intermediate_size)", cfg.intermediate_size),
            **({"expert": ("experts", cfg.moe.num_experts),
                "expert_mlp": ("expert MLP width", cfg.moe.intermediate_size)} if cfg.moe is not None else {}),
            "vocab": (f"padded vocabulary (vocab_size {cfg.vocab_size} padded)", cfg.padded_vocab_size)}
    for logical, (what, size) in dims.items():
        if rules.get(logical) == MODEL and size % tp:
            raise ValueError(f"layout {layout.name}: TP={tp} does not divide the {size} {what}; "
                             f"choose a TP size that divides {size}")
    notes = []
    factor = kv_duplication(cfg, tp, layout.rules)
    if factor > 1:
        notes.append(f"{cfg.num_kv_heads} KV heads duplicated {factor}x to {cfg.num_kv_heads * factor}: one per "
                     f"device, as serving does (parallel/kv_heads.py, model/kv_heads.py)")
    elif rules.get("kv_heads") != MODEL or cfg.num_kv_heads % tp:
        notes.append(f"{cfg.num_kv_heads} KV heads whole on every device (KV pool and K/V projections "
                     f"replicated; attention takes the jnp path)")
    return notes


def candidate_layouts(cfg: ModelConfig, num_devices: int) -> list[Layout]:
    """Every layout of RULE_SETS x TP size (a divisor of the device count) that divides the model."""
    out = []
    for name in RULE_SETS:
        if name in DATA_AXIS_LAYOUTS or ("-ep" in name and cfg.moe is None):
            continue  # planned replicas have no data axis; experts split only in an MoE
        for tp in range(1, num_devices + 1):
            if num_devices % tp:
                continue
            layout = make_layout(name, num_devices, tp)
            if name != "tp" and tp == 1:
                continue  # with one device per replica every rule set is the same layout
            try:
                check_divides(layout, cfg)
            except ValueError:
                continue
            out.append(layout)
    return out
