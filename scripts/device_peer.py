"""The device check's peer stage: Hugging Face transformers (PyTorch) on the served model's shape and
the burst's workload, on the same accelerator, after the server has exited.

Weights are random (transformers' own init at the config's initializer_range, bf16 on a GPU, the
dtype jaxserve serves in elsewhere), built on the device. Two ways transformers serves a batch:
  static     one `generate` over every request at once: prompts left-padded, greedy, EOS
             suppressed, the batch runs until its longest request is done; only each request's own
             output tokens count (the rest is static batching's waste)
  continuous `generate_batch` (transformers' continuous batching), where this version has it: one
             max_new_tokens for every request (its API takes one), tokens counted as generated;
             on a GPU its cache is sized as users get it (from free device memory); on a CPU
             transformers would size it from free host RAM (13.6 GiB for the dry run's 6 requests,
             which starved the test suite's other worker), so there it holds the burst and no more
The same prompts (token ids) and output lengths as the served burst (bench_serving.build_prompts).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from device_profile import Profile, model_dir
from device_stages import Result, log


def stage_peer(profile: Profile, work: Path, result: Result, args: dict) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import bench_serving as bs

    directory = model_dir(profile.model, work / "model")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    w = profile.workload
    config = bs.BenchConfig(base_url="", model=str(directory), tokenizer=str(directory), num_requests=w.num_requests,
                            prompt_len_min=w.prompt_len[0], prompt_len_max=w.prompt_len[1],
                            output_len_min=w.output_len[0], output_len_max=w.output_len[1], prompt_as="ids")
    prompts = bs.build_prompts(config, bs.load_tokenizer(str(directory)))
    start = time.monotonic()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=dtype).eval()
    if device == "cuda":
        torch.cuda.synchronize()
    result.set(device=device, dtype=str(dtype).removeprefix("torch."), torch=torch.__version__,
               build_s=time.monotonic() - start)
    log(f"transformers model built on {device} in {time.monotonic() - start:.1f} s")
    result.set(static=_static(model, prompts, device))
    result.set(status="PASS", continuous="running")  # replaced by its figures, or left so when stopped
    try:
        result.set(continuous=_continuous(model, prompts, device))
    except Exception as e:  # noqa: BLE001 — reported, the static figure stands on its own
        result.set(continuous=None)
        result.note(f"continuous batching did not run: {type(e).__name__}: {str(e)[:300]}")


def _static(model: Any, prompts: list[Any], device: str) -> dict[str, Any]:
    import torch

    ids = [list(p.prompt) for p in prompts]
    width = max(len(x) for x in ids)
    pad = 0
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=device)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
    longest = max(p.output_len for p in prompts)

    def generate(rows: int, new_tokens: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids[:rows], attention_mask=mask[:rows], max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        if device == "cuda":
            torch.cuda.synchronize()
        if out.shape[1] - width != new_tokens:
            raise RuntimeError(f"generate produced {out.shape[1] - width} tokens, expected {new_tokens}")
        return time.perf_counter() - t

    generate(min(4, len(ids)), 2)  # warm-up: kernels, allocator
    seconds = generate(len(ids), longest)
    useful = sum(p.output_len for p in prompts)
    log(f"transformers static batch of {len(ids)}: {seconds:.1f} s, {useful / seconds:.0f} output tok/s")
    return dict(requests=len(ids), padded_prompt=width, new_tokens=longest, duration_s=seconds,
                output_tokens=useful, output_throughput=useful / seconds,
                total_token_throughput=(useful + sum(p.prompt_len for p in prompts)) / seconds)


def _continuous(model: Any, prompts: list[Any], device: str) -> dict[str, Any]:
    from transformers import GenerationConfig

    if not hasattr(model, "generate_batch"):
        raise NotImplementedError("this transformers has no generate_batch")
    longest = max(p.output_len for p in prompts)
    gen = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=-1, pad_token_id=0)
    sizing = {} if device == "cuda" else {"continuous_batching_config": _burst_sized_cache(prompts, longest)}
    t = time.perf_counter()
    outputs = model.generate_batch(inputs=[list(p.prompt) for p in prompts], generation_config=gen,
                                   progress_bar=False, **sizing)
    seconds = time.perf_counter() - t
    produced = sum(len(o.generated_tokens) for o in outputs.values())
    log(f"transformers continuous batching: {seconds:.1f} s, {produced / seconds:.0f} output tok/s")
    return dict(requests=len(outputs), new_tokens=longest, duration_s=seconds, output_tokens=produced,
                output_throughput=produced / seconds)


def _burst_sized_cache(prompts: list[Any], new_tokens: int) -> Any:
    """A continuous-batching cache that holds every request of the burst at once (its pages) and
    prefills every prompt in one batch, instead of one sized from free host RAM."""
    from transformers import ContinuousBatchingConfig

    page = ContinuousBatchingConfig().page_size
    pages = sum(-(-(p.prompt_len + new_tokens) // page) for p in prompts)
    return ContinuousBatchingConfig(num_blocks=pages, max_batch_tokens=sum(p.prompt_len for p in prompts))
