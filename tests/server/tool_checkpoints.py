"""Model directories that hold the session's weights (jaxserve-tiny) under other tokenizers, written
by transformers' `save_pretrained`, for the tool-calling server tests.

Servers of the session share one engine core, so only the tokenizer may differ; these are the ways
real checkpoints differ in what matters to tool calling: whether the chat template renders `tools`,
and how the vocabulary holds the Hermes tags `<tool_call>` / `</tool_call>`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# ChatML with no tools section: `tools` are ignored, as by many base models and fine-tunes.
PLAIN_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '')"
                " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                "{% endif %}")
CHATML_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# name -> what it is; "tiny" is the embedded default model itself.
CHECKPOINTS = {
    "tiny": "Qwen3 template that renders tools; tags are added tokens, not special",
    "plain-special": "plain ChatML; tags are added tokens marked special (dropped by skip_special_tokens)",
    "plain-no-tags": "plain ChatML; a vocabulary without tag tokens (Qwen1.5's added tokens only)",
}


def checkpoint(name: str, tiny_dir: Path, directory: Path) -> Path:
    """The model directory `name` (see CHECKPOINTS), written under `directory` unless it is "tiny"."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from tokenizers import Tokenizer as RustTokenizer

    if name == "tiny":
        return tiny_dir
    out = directory / name
    out.mkdir(parents=True)
    for file in ("config.json", "generation_config.json", "model.safetensors"):
        os.symlink(tiny_dir / file, out / file)
    hf: Any = AutoTokenizer.from_pretrained(str(tiny_dir))
    if name == "plain-special":
        hf.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]},
                              replace_extra_special_tokens=False)
    elif name == "plain-no-tags":
        spec = json.loads(hf.backend_tokenizer.to_str())
        spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in CHATML_TOKENS]
        hf = PreTrainedTokenizerFast(tokenizer_object=RustTokenizer.from_str(json.dumps(spec)),
                                     eos_token="<|im_end|>", pad_token="<|endoftext|>")
    else:
        raise ValueError(f"unknown checkpoint {name!r}; known: {', '.join(CHECKPOINTS)}")
    hf.chat_template = PLAIN_CHATML
    hf.save_pretrained(str(out))
    return out
