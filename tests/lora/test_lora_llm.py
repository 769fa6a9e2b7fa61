"""The offline API with LoRA: LLM(enable_lora=True, lora_modules=...) and generate(lora_name=...)
give the base model's and the adapter's tokens as the engine does (the merged transformers model
is the oracle)."""

from __future__ import annotations

import torch
import transformers

from jaxserve.default_model import ensure_default_model
from jaxserve.entrypoints.llm import LLM
from jaxserve.core.sampling_params import SamplingParams
from peft_adapters import write_adapter

PROMPT = [9707, 11, 1879, 0, 576, 3974]


def test_generate_on_a_named_adapter(tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()
    merged = write_adapter(hf, tmp_path / "ad", seed=7, r=4, modules=("q_proj", "up_proj")).merge_and_unload()
    with torch.no_grad():
        want = merged.generate(input_ids=torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                               do_sample=False, max_new_tokens=6, min_new_tokens=6, eos_token_id=None,
                               pad_token_id=0)[0, len(PROMPT):].tolist()
    llm = LLM(show_progress=False, enable_lora=True, lora_modules=(("ad", str(tmp_path / "ad")),), max_loras=1,
              max_lora_rank=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_kv_pages=16,
              token_buckets=(16,), seq_buckets=(4,))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert llm.generate([PROMPT], params, lora_name="ad")[0].outputs[0].token_ids == want
    assert llm.generate([PROMPT], params)[0].outputs[0].token_ids != want
