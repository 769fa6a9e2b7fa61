"""The whole serving set (every declared forward bucket with the Pallas kernel, every sampler,
the page copy) compiles for TPUs this machine does not have, from shapes alone, for two model
families: what `jaxserve serve` would run on a v6e-4 with TP=4 and on a v5e-4 as two TP=2 replicas."""

from __future__ import annotations

import pytest

from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.parallel.layouts import make_layout
from jaxserve.model.attention import make_attention
from jaxserve.core.buckets import serving_programs
from jaxserve.runner.programs import lower_program
from jaxserve.parallel.sharding import make_mesh, Placement
from jaxserve.planning.targets import parse_target
from own_process import in_own_process

FAMILIES = {
    # Qwen3: q/k norms, GQA 2, bf16
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
              "head_dim": 128, "max_position_embeddings": 512, "tie_word_embeddings": True},
    # Mistral: sliding window on every layer, untied lm_head, GQA 4
    "mistral": {"architectures": ["MistralForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
                "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 16,
                "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 512, "sliding_window": 64,
                "tie_word_embeddings": False},
}
ENGINE = EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, num_kv_pages=64)


@pytest.mark.parametrize("target,tp", [("tpu-v6e:2x2", 4), ("tpu-v5e:2x2", 2)])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_serving_program_compiles_for_tpu(target, tp, family):
    cfg = ModelConfig.from_hf(FAMILIES[family])
    devices = parse_target(target).devices()
    layout = make_layout("tp", len(devices), tp)
    mesh = make_mesh(1, layout.tp, devices)
    placement = Placement(mesh, layout.rules)
    attention = make_attention("auto", cfg, placement)
    assert attention.__name__ == "shard_map_ragged_paged_attention_tpu"  # the Mosaic kernel, per device
    programs = serving_programs(ENGINE, cfg)
    assert [p.kind for p in programs].count("forward") == 4  # tokens {16, 32} x seqs {4, 8}
    for program in programs:
        if program.kind == "sample" and family != "qwen3":
            continue  # a sampler sees only the vocabulary and the mesh: the same program for both families
        compiled = lower_program(program, cfg, ENGINE, placement, "bfloat16", attention).compile()
        assert compiled.memory_analysis() is not None
        if program.kind == "forward":
            text = compiled.as_text()
            assert "tpu_custom_call" in text, program.name            # the kernel, not a jnp fallback
            assert "all-reduce" in text, program.name                 # TP: partial sums meet


def _sampler_program(devices, history: int):
    """The serving sampler at 256 rows of a 151,936 vocabulary with a `history`-id table, compiled for
    `devices` (one)."""
    from jaxserve.core.buckets import Program
    cfg = ModelConfig.from_hf({**FAMILIES["qwen3"], "vocab_size": 151936})
    engine = EngineConfig(max_num_seqs=256, max_num_batched_tokens=256, max_model_len=8192, num_kv_pages=64)
    mesh = make_mesh(1, 1, devices)
    return lower_program(Program("sample", rows=256, history=history), cfg, engine, Placement(mesh), "bfloat16",
                         make_attention("auto", cfg, Placement(mesh))).compile()


def test_widest_sampler_fits_in_small_temporaries_on_tpu():
    """The sampler's inputs (256 rows x a 16384-id penalty table) arrive as one packed buffer; on TPU
    a flat buffer cost 256 bytes of temporaries per word in relayouts (4 GiB here). Packed by rows
    it costs about the logits' own working set."""
    compiled = _sampler_program(parse_target("tpu-v6e:1x1").devices(), 16384)
    logits_bytes = 256 * 151936 * 4
    assert compiled.memory_analysis().temp_size_in_bytes < 6 * logits_bytes  # 0.9 GiB; flat packing: 4 GiB


@pytest.mark.gpu_compile
def test_sampler_programs_compile_for_an_h100():
    """The sampler program (every branch: greedy ids, the draw, logprobs, the grammar mask) compiles
    for an H100 at 256 rows, with no table and with the widest (16384 ids); without a table it holds
    no copy of the [R, V] logits (with one, the penalties' in-place update copies them, in its branch)."""
    from jaxserve.planning.gpu_target import gpu_devices

    for history in (0, 16384):
        hlo = _sampler_program(gpu_devices("h100", "1x1x1"), history).as_text()
        copies = [line for line in hlo.splitlines() if " copy(" in line and "f32[256,151936]" in line.split("copy(")[0]]
        assert history or not copies, copies


def test_speculative_draft_row_programs_compile_for_tpu():
    """With speculative decoding a forward bucket also declares L = min(T, S (1 + k)) logits rows
    (every draft is sampled): those forwards and their samplers compile for a v6e-4 with TP=4."""
    import dataclasses

    cfg = ModelConfig.from_hf(FAMILIES["qwen3"])
    engine = dataclasses.replace(ENGINE, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    devices = parse_target("tpu-v6e:2x2").devices()
    layout = make_layout("tp", len(devices), 4)
    mesh = make_mesh(1, layout.tp, devices)
    placement = Placement(mesh, layout.rules)
    attention = make_attention("auto", cfg, placement)
    plain_rows = {p.rows for p in serving_programs(ENGINE, cfg) if p.kind == "sample"}
    extra = [p for p in serving_programs(engine, cfg)
             if (p.kind == "forward" and p.logits != p.rows) or (p.kind == "sample" and p.rows not in plain_rows)]
    assert {p.logits for p in extra if p.kind == "forward"} == {16, 32}  # (16, 4) -> 16, (32, 8) -> 32
    for program in extra:
        compiled = lower_program(program, cfg, engine, placement, "bfloat16", attention).compile()
        assert compiled.memory_analysis() is not None, program.name


def test_lora_forward_compiles_for_tpu():
    """A LoRA-enabled forward (slot one-hots, the masked products under lax.cond, slots sharded like the layers)
    compiles for a v6e-4 with TP=4 at the decode and the largest bucket."""
    import dataclasses

    cfg = ModelConfig.from_hf(FAMILIES["qwen3"])
    engine = dataclasses.replace(ENGINE, enable_lora=True, max_loras=4, max_lora_rank=16)
    devices = parse_target("tpu-v6e:2x2").devices()
    layout = make_layout("tp", len(devices), 4)
    mesh = make_mesh(1, layout.tp, devices)
    placement = Placement(mesh, layout.rules)
    attention = make_attention("auto", cfg, placement)
    forwards = [p for p in serving_programs(engine, cfg) if p.kind == "forward"]
    for program in (forwards[0], forwards[-1]):
        compiled = lower_program(program, cfg, engine, placement, "bfloat16", attention).compile()
        assert "tpu_custom_call" in compiled.as_text(), program.name


def _eagle3_programs(devices, tp: int, kernel: str) -> None:
    """The target forward that also returns the head's input states, the head's fill after it (with
    its draft rows) and its proposal forward, at the smallest and largest bucket, compile for
    `devices` with TP=`tp`, each with the attention kernel (`kernel` in the HLO)."""
    import dataclasses

    from jaxserve.runner.proposers.hidden_heads import lower_head
    from jaxserve.model.eagle3 import Eagle3Config

    cfg = ModelConfig.from_hf({**FAMILIES["qwen3"], "num_hidden_layers": 4})
    head = Eagle3Config.from_hf(
        {"architectures": ["LlamaForCausalLMEagle3"], "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 512,
         "draft_vocab_size": 256, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 3]}},
        cfg, {"d2t", "fc.weight"})
    engine = dataclasses.replace(ENGINE, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    layout = make_layout("tp", len(devices), tp)
    mesh = make_mesh(1, layout.tp, devices)
    placement = Placement(mesh, layout.rules)
    attention = make_attention("auto", cfg, placement)
    head_attention = make_attention("auto", head.layer, placement)
    forwards = [p for p in serving_programs(engine, cfg) if p.kind == "forward"]
    for program in (forwards[0], forwards[-1]):
        lowered = lower_program(program, cfg, engine, placement, "bfloat16", attention, aux_layers=head.aux_layers)
        assert kernel in lowered.compile().as_text(), program.name
        for combine in (True, False):
            compiled = lower_head(program, head, cfg, engine, placement, "bfloat16", head_attention,
                                   combine=combine).compile()
            assert kernel in compiled.as_text(), (program.name, combine)


def test_eagle3_programs_compile_for_tpu():
    _eagle3_programs(parse_target("tpu-v6e:2x2").devices(), 4, "tpu_custom_call")


@pytest.mark.gpu_compile
def test_eagle3_programs_compile_for_two_h100s():
    from jaxserve.planning.gpu_target import gpu_devices

    _eagle3_programs(gpu_devices("h100", "1x1x2"), 2, "__gpu$xla.gpu.triton")


MOE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
       "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
       "max_position_embeddings": 512, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
       "norm_topk_prob": True}


def _largest_forward(cfg, devices, rules: str, tp: int) -> str:
    """The compiled HLO text of the largest forward of `cfg` on `devices`."""
    layout = make_layout(rules, len(devices), tp)
    mesh = make_mesh(1, layout.tp, devices)
    placement = Placement(mesh, layout.rules)
    program = [p for p in serving_programs(ENGINE, cfg) if p.kind == "forward"][-1]
    return lower_program(program, cfg, ENGINE, placement, "bfloat16", make_attention("auto", cfg, placement)
                         ).compile().as_text()


def _kernel_calls(text: str, marker: str) -> int:
    """Kernel launches (`marker` custom calls) in an HLO text."""
    return sum(1 for line in text.splitlines() if marker in line and "custom-call(" in line)


@pytest.mark.parametrize("rules", ["tp", "tp-ep"])
@in_own_process
def test_moe_forward_runs_its_grouped_matmuls_as_mosaic_kernels_on_tpu(rules):
    """Each sparse layer's three expert projections are tokamax's Mosaic ragged-dot kernel on a
    v6e-4 (TP=4: each expert's width split, or tp-ep: whole experts per device): at least three
    more kernel launches per layer than the same model with dense MLPs (tokamax adds a launch of
    its own to one of them)."""
    import dataclasses

    moe = ModelConfig.from_hf(MOE)
    dense = dataclasses.replace(moe, moe=None)
    devices = parse_target("tpu-v6e:2x2").devices()
    text = _largest_forward(moe, devices, rules, 4)
    extra = _kernel_calls(text, "tpu_custom_call") - _kernel_calls(_largest_forward(dense, devices, "tp", 4),
                                                                   "tpu_custom_call")
    assert 3 * moe.num_layers <= extra <= 4 * moe.num_layers
    # expert parallelism moves tokens to their experts' devices and back by all-to-all
    assert (text.count("all-to-all-start(") + text.count("all-to-all(") >= 3 * moe.num_layers) == (rules == "tp-ep")


@pytest.mark.gpu_compile
@in_own_process
def test_moe_forward_runs_its_grouped_matmuls_as_triton_kernels_on_two_h100s():
    """tokamax's Triton ragged-dot kernel under jax 0.10; under jax 0.11, XLA's ragged_dot
    (model/moe.GPU_IMPLEMENTATIONS says why): no kernel beyond the dense model's attention."""
    import dataclasses

    from jaxserve.planning.gpu_target import gpu_devices
    from jaxserve.model.moe import GPU_IMPLEMENTATIONS

    moe = ModelConfig.from_hf(MOE)
    devices = gpu_devices("h100", "1x1x2")
    marker = "__gpu$xla.gpu.triton"
    for rules in ("tp", "tp-ep"):
        extra = (_kernel_calls(_largest_forward(moe, devices, rules, 2), marker)
                 - _kernel_calls(_largest_forward(dataclasses.replace(moe, moe=None), devices, "tp", 2), marker))
        if GPU_IMPLEMENTATIONS[0] == "triton":
            assert 3 * moe.num_layers <= extra <= 4 * moe.num_layers, rules
        else:
            assert extra == 0, rules


def _jnp_fallback_forwards(devices) -> None:
    """Every forward of a model whose 4 KV heads do not split over an 8-way model axis: attention
    runs the tiled jnp path (decode blocks sorted by context, prefill tiles), partitioned by XLA."""
    cfg = ModelConfig.from_hf(FAMILIES["qwen3"])
    layout = make_layout("tp", len(devices), len(devices))
    mesh = make_mesh(1, layout.tp, devices)
    placement = Placement(mesh, layout.rules)
    attention = make_attention("auto", cfg, placement)
    assert attention.__name__ == "ragged_paged_attention_tiled"
    for program in serving_programs(ENGINE, cfg):
        if program.kind == "forward":
            compiled = lower_program(program, cfg, ENGINE, placement, "bfloat16", attention).compile()
            assert "sort" in compiled.as_text(), program.name  # the decode rows ordered by context


def test_jnp_attention_fallback_compiles_for_tpu():
    _jnp_fallback_forwards(parse_target("tpu-v6e:2x4").devices())


@pytest.mark.gpu_compile
def test_jnp_attention_fallback_compiles_for_eight_h100s():
    from jaxserve.planning.gpu_target import gpu_devices

    _jnp_fallback_forwards(gpu_devices("h100", "1x1x8"))


def test_host_tier_page_moves_compile_for_tpu():
    """The host KV tier's gather (pages out of the pool) and scatter (pages back, pool donated) for
    every run width, on a v6e-4 pool split over its KV heads."""
    import jax
    import jax.numpy as jnp

    from jaxserve.model import kv_cache
    from jaxserve.runner.host_tier import CHUNK_WIDTHS, gather_pages, scatter_pages
    from jaxserve.parallel.sharding import replicated

    cfg = ModelConfig.from_hf(FAMILIES["qwen3"])
    mesh = make_mesh(1, 4, parse_target("tpu-v6e:2x2").devices())
    pool = kv_cache.abstract(cfg, 64, 16, jnp.bfloat16, Placement(mesh))
    for width in CHUNK_WIDTHS:
        index = jax.ShapeDtypeStruct((width,), jnp.int32, sharding=replicated(mesh))
        run = jax.eval_shape(gather_pages, pool, index)
        assert run.k[0].shape == (width, 16, cfg.num_kv_heads, cfg.head_dim)
        assert gather_pages.lower(pool, index).compile().memory_analysis() is not None
        assert scatter_pages.lower(pool, run, index).compile().memory_analysis() is not None
