"""The device check's feature stage: every served feature's programs run once on the accelerator,
on a model of the served model's widths with `features_layers` layers (random weights drawn on the
device), each against the plain engine's greedy tokens for the same prompts.

  lossless (must equal the plain engine): n-gram speculation; requests without an adapter on a
            LoRA-enabled engine
  lossy (agreement reported, not required): int8 and fp8 KV pages, int8 weights; a request on a
            random LoRA adapter (its tokens differ by design)
  constrained: a JSON-schema request whose output must parse and carry the schema's keys
Per variant: seconds to build and warm up the engine, to generate, its steps and their mean time,
the mean decode-only step (none under speculation: its steps verify drafts) and the rows/tokens
that agree with the plain engine. One engine at a time; each is dropped before the
next is built (its KV pool is sized small: the accelerator's memory is not the point here).
"""
from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from device_profile import Profile, model_dir
from device_stages import Result, log

MAX_TOKENS = 24
LORA_RANK = 8
# one sequence bucket and three token buckets: ~7 programs per engine
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=512, num_kv_pages=256)
# bounded, so that a random model's constrained output closes within the request's tokens
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 30}},
          "required": ["city", "days"], "additionalProperties": False}


def stage_features(profile: Profile, work: Path, result: Result, args: dict) -> None:
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.structured.spec import StructuredOutputs

    deadline = time.monotonic() + float(args.get("seconds", 150))
    directory = model_dir(profile.model, work / "features-model", profile.features_layers)
    adapter = write_random_adapter(work / "adapter", profile.model, profile.features_layers)
    prompts = _prompts(profile.model["vocab_size"])
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = _variant("plain", directory, {}, prompts, greedy)
    reference = plain.pop("tokens")
    rows = [plain]
    result.set(layers=profile.features_layers, variants=rows)
    variants: list[tuple[str, dict, str]] = [
        ("ngram speculation", dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                       "prompt_lookup_max": 3}), "equal"),
        ("lora, base rows", dict(enable_lora=True, max_loras=1, max_lora_rank=LORA_RANK,
                                 lora_modules=(("random", str(adapter)),)), "equal"),
        ("int8 KV pages", dict(kv_cache_dtype="int8"), "lossy"),
        ("fp8 KV pages", dict(kv_cache_dtype="fp8"), "lossy"),
        ("int8 weights", dict(quantization="int8"), "lossy"),
    ]
    failed = []
    for name, overrides, kind in variants:
        if time.monotonic() > deadline - 15:
            result.note(f"{name}: not run (time limit)")
            continue
        extra = None
        if overrides.get("enable_lora"):
            extra = lambda llm: _lora_row(llm, prompts, greedy)  # noqa: E731
        row = _variant(name, directory, overrides, prompts, greedy, extra)
        row.update(_agreement(reference, row.pop("tokens")), kind=kind)
        if kind == "equal" and row["identical_rows"] != len(prompts):
            failed.append(f"{name}: {row['identical_rows']}/{len(prompts)} rows equal the plain engine")
        rows.append(row)
        result.set(variants=rows)
    if time.monotonic() < deadline - 15:
        schema = SamplingParams(temperature=0.0, max_tokens=96,
                                structured_outputs=StructuredOutputs(json=SCHEMA))
        row = _variant("json schema", directory, {}, prompts[:1], schema, decode=True)
        text = row.pop("texts")[0]
        row.pop("tokens")
        try:
            value = json.loads(text)
            row["valid"] = isinstance(value, dict) and set(SCHEMA["required"]) <= set(value)
        except json.JSONDecodeError:
            row["valid"] = False
        row["text"] = text[:200]
        if not row["valid"]:
            failed.append(f"json schema: output {text[:80]!r} does not parse as the schema")
        rows.append(row)
        result.set(variants=rows)
    else:
        result.note("json schema: not run (time limit)")
    result.set(status="FAIL" if failed else "PASS", failed=failed)


def _prompts(vocab: int) -> list[list[int]]:
    """4 prompts of 64 ids, each a 16-id phrase said 4 times (so n-gram lookup finds proposals)."""
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(100, min(vocab, 150000), 16)] * 4 for _ in range(4)]


def _variant(name: str, directory: Path, overrides: dict, prompts: list[list[int]], params: Any,
             extra: Any = None, decode: bool = False) -> dict[str, Any]:
    from jaxserve.entrypoints.llm import LLM

    start = time.monotonic()
    llm = LLM(str(directory), show_progress=False, load_format="dummy", **{**ENGINE, **overrides})
    built = time.monotonic() - start
    start, steps_before = time.monotonic(), llm.core.timings.steps
    outputs = llm.generate(prompts, params)
    generated = time.monotonic() - start
    steps = llm.core.timings.steps - steps_before
    decode_steps = list(llm.core.timings.decode.values())
    decodes = sum(d.steps for d in decode_steps)
    row = dict(variant=name, build_s=built, generate_s=generated, programs=llm.core.runner.programs.compiled,
               steps=steps, step_ms=1e3 * generated / max(1, steps),
               decode_step_ms=1e3 * sum(d.seconds for d in decode_steps) / decodes if decodes else None,
               tokens=[o.outputs[0].token_ids for o in outputs])
    if decode:
        row["texts"] = [o.outputs[0].text for o in outputs]
    if extra is not None:
        row.update(extra(llm))
    log(f"{name}: built in {built:.1f} s, generated in {generated:.2f} s")
    del llm
    gc.collect()
    return row


def _lora_row(llm: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    """The adapter's own request (its tokens differ from the base model's by design)."""
    base = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params)]
    adapted = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params, lora_name="random")]
    return dict(adapter_tokens_differ=adapted != base)


def _agreement(reference: list[list[int]], tokens: list[list[int]]) -> dict[str, Any]:
    """Rows identical to the plain engine's, and the share of tokens before each row's first difference."""
    same = 0
    prefix = 0
    for ref, got in zip(reference, tokens):
        same += ref == got
        prefix += next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    return dict(rows=len(reference), identical_rows=same,
                prefix_agreement=prefix / max(1, sum(len(r) for r in reference)))


def write_random_adapter(dest: Path, model: dict[str, Any], layers: int, seed: int = 0) -> Path:
    """A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) of rank LORA_RANK on
    q_proj and v_proj of every layer, random A and B, written with numpy (no torch, no peft)."""
    from safetensors.numpy import save_file

    dest.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    d, hd = model["hidden_size"], model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
    outs = {"q_proj": model["num_attention_heads"] * hd, "v_proj": model["num_key_value_heads"] * hd}
    tensors = {}
    for i in range(layers):
        for module, out in outs.items():
            key = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((LORA_RANK, d)) * d ** -0.5).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out, LORA_RANK)) * 0.02).astype(np.float32)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    (dest / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": 2 * LORA_RANK,
        "target_modules": list(outs), "bias": "none", "use_rslora": False, "base_model_name_or_path": None}))
    return dest
