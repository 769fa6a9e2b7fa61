"""What the engine serves for a hybrid stack (linear-attention layers with recurrent states) today,
decided before anything is allocated. Pure Python.

A recurrent state holds a sequence's whole past in one slot, so the features that restore or roll
back a sequence by its K/V pages alone would be wrong for it: the host tier and PD transfer (which
move pages, not the states snapshotted beside them: engine/state_slots.py), speculative decoding
(rejected drafts would stay in the state), and LoRA (no adapter math for the linear layers yet).
They are refused by name. Prefix caching restores a state snapshot with the pages.
"""

from __future__ import annotations

from jaxserve.core.config import EngineConfig, ModelConfig


def check_linear(engine: EngineConfig, model: ModelConfig) -> None:
    """ValueError naming a setting that cannot be served with linear-attention layers."""
    if model.linear is None:
        return
    refused = {"--speculative-config": engine.speculative_config is not None, "--enable-lora": engine.enable_lora,
               "--kv-offload-gib": engine.kv_offload_gib is not None, "--kv-role": engine.kv_role is not None}
    for flag, asked in refused.items():
        if asked:
            raise ValueError(f"{flag} is not supported yet for {model.architecture}: its linear-attention layers keep "
                             "a recurrent state per sequence, which this feature would not restore")
