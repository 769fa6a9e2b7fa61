"""PEFT adapters for the LoRA tests, written by PEFT itself (the format users bring)."""

from __future__ import annotations

import peft
import torch

from jaxserve.lora.adapter import MODULES


def write_adapter(model, directory, seed: int, r: int = 8, modules=MODULES, **kw):
    """A PEFT adapter with random A and B (init_lora_weights=False: B is not zero), saved to
    `directory`; returns the PEFT-wrapped model (merge_and_unload() gives the oracle)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(modules), init_lora_weights=False, **kw)
    wrapped = peft.get_peft_model(model, config)
    wrapped.save_pretrained(directory)
    return wrapped
