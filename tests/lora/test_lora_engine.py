"""Multi-LoRA through the engine: requests for three PEFT adapters and the base model mixed in one
batch each get the greedy tokens of the transformers model with their adapter merged (and of running
alone), prefix-cache pages are never shared across adapters, nothing compiles after warm-up, and an
unknown adapter name is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from checkpoints import load_model
from engine_utils import greedy, make_core, run_all
from hf_models import make_hf_model
from jaxserve.core.request import Request
from jaxserve.parallel.sharding import make_mesh
from peft_adapters import write_adapter

PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 12, 60], [60, 3, 3, 88, 12, 19, 4]]
NEW = 12
ADAPTERS = {"a1": dict(seed=1), "a2": dict(seed=2, r=4, modules=("q_proj", "v_proj", "o_proj")),
            "a3": dict(seed=3, use_rslora=True)}


def _hf_greedy(model, prompt):
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    base_dir, _ = make_hf_model("llama3-gqa-tied", d / "base", seed=4)
    expected = {}
    for name, kw in ADAPTERS.items():
        _, fresh = make_hf_model("llama3-gqa-tied", d / f"copy-{name}", seed=4)  # the same base weights
        merged = write_adapter(fresh, d / name, **kw).merge_and_unload()
        expected[name] = [_hf_greedy(merged, p) for p in PROMPTS]
    _, base = make_hf_model("llama3-gqa-tied", d / "copy-base", seed=4)
    expected[None] = [_hf_greedy(base, p) for p in PROMPTS]
    cfg, weights = load_model(base_dir, make_mesh(1, 1))
    core = make_core(cfg, weights, enable_lora=True, max_loras=4, max_lora_rank=8,
                     lora_modules=tuple((name, str(d / name)) for name in ADAPTERS))
    return core, expected, base_dir


def _assert_outputs(out, tag, names, expected):
    for name in names:
        for i in range(len(PROMPTS)):
            assert out[f"{tag}-{name}-{i}"][0] == expected[name][i], (name, i)


def _on_model_axis(base_dir, lora_modules, model_axis: int, max_loras: int):
    """A LoRA core over the same base checkpoint and adapters on a 1 x model_axis mesh."""
    mesh = make_mesh(1, model_axis)
    cfg, weights = load_model(base_dir, mesh)
    return make_core(cfg, weights, mesh=mesh, enable_lora=True, max_loras=max_loras, max_lora_rank=8,
                     lora_modules=lora_modules), cfg


def _requests(tag, names):
    return [Request(f"{tag}-{name}-{i}", p, greedy(NEW), lora_name=name) for name in names
            for i, p in enumerate(PROMPTS)]


def test_mixed_adapters_in_one_batch_equal_their_merged_models(setup):
    core, expected, _ = setup
    names = [*ADAPTERS, None]
    out = run_all(core, _requests("mix", names))
    _assert_outputs(out, "mix", names, expected)
    assert len({tuple(out[f"mix-{n}-0"][0]) for n in names}) == len(names)  # adapters do change outputs
    alone = run_all(core, _requests("alone", ["a2"])[:1])
    assert alone["alone-a2-0"][0] == expected["a2"][0]
    assert core.runner.compilations_after_warmup == 0


def test_prefix_cache_pages_are_never_shared_across_adapters(setup):
    core, _, _ = setup
    prompt = list(range(3, 40))                      # 37 tokens: 9 full pages of 4
    hits = core.stats().prefix_cache_hits
    run_all(core, [Request("p1", prompt, greedy(2), lora_name="a1")])
    run_all(core, [Request("p2", prompt, greedy(2), lora_name="a3")])
    run_all(core, [Request("p3", prompt, greedy(2))])
    assert core.stats().prefix_cache_hits == hits    # other adapter / base: no hit
    run_all(core, [Request("p4", prompt, greedy(2), lora_name="a1")])
    assert core.stats().prefix_cache_hits - hits == 36  # the same adapter: its 9 pages


def test_waiting_counts_per_adapter_and_an_unknown_adapter_is_refused(setup):
    core, _, _ = setup
    for i, name in enumerate(["a1", "a1", "a2", None]):   # nothing runs yet: all four wait
        core.add_request(Request(f"w{i}", [1, 2, 3], greedy(2), lora_name=name))
    stats = core.stats()
    assert stats.lora_waiting == {"a1": 2, "a2": 1} and stats.lora_running == {}
    while core.has_work():
        core.step()
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'; served: a1, a2, a3"):
        core.add_request(Request("x", [1, 2], greedy(2), lora_name="nope"))


def test_eight_adapters_cycle_through_four_slots_under_load(tmp_path):
    """8 adapters, 4 device slots, 2 kept in host memory: 16 adapter requests and 2 base ones at
    once (8 run at a time); every output is its merged model's, slots are reloaded as adapters
    come and go, and nothing compiles after warm-up."""
    base_dir, _ = make_hf_model("qwen2-bias", tmp_path / "base", seed=6)
    names = [f"t{i}" for i in range(8)]
    expected = {}
    for i, name in enumerate(names):
        _, fresh = make_hf_model("qwen2-bias", tmp_path / f"copy{i}", seed=6)
        merged = write_adapter(fresh, tmp_path / name, seed=10 + i, r=4 + 2 * (i % 3)).merge_and_unload()
        expected[name] = [_hf_greedy(merged, p) for p in PROMPTS]
    _, base = make_hf_model("qwen2-bias", tmp_path / "copy-base", seed=6)
    expected[None] = [_hf_greedy(base, p) for p in PROMPTS]
    cfg, weights = load_model(base_dir, make_mesh(1, 1))
    core = make_core(cfg, weights, enable_lora=True, max_loras=4, max_lora_rank=8, max_cpu_loras=4,
                     lora_modules=tuple((n, str(tmp_path / n)) for n in names))
    _assert_outputs(run_all(core, _requests("cyc", [*names, None])), "cyc", [*names, None], expected)
    assert core.runner.lora.num_loads >= 8 and core.scheduler.lora_slots.num_loads == core.runner.lora.num_loads
    assert all(p == 0 for p in core.scheduler.lora_slots.pins)
    assert core.runner.compilations_after_warmup == 0


def test_mixed_adapters_on_a_two_way_model_axis(setup, tmp_path):
    """TP=2 (the base weights and the adapter slots sharded alike): the same outputs."""
    core, expected, base_dir = setup
    sharded, _ = _on_model_axis(base_dir, core.engine_cfg.lora_modules, model_axis=2, max_loras=2)
    layer = sharded.runner.lora.arrays[0]
    spec = lambda x: tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))  # noqa: E731
    assert spec(layer["q_proj"][1]) == (None, None, "model", None)    # b over the q heads
    assert spec(layer["o_proj"][0]) == ("model", None, None, None)    # a over the q heads (its input)
    assert spec(layer["down_proj"][0]) == ("model", None, None)       # a over mlp (its input)
    names = [*ADAPTERS, None]
    _assert_outputs(run_all(sharded, _requests("tp", names)), "tp", names, expected)
    assert sharded.runner.compilations_after_warmup == 0


@pytest.mark.parametrize("variant", ["qwen3-qknorm", "mistral-window"])
def test_greedy_generation_with_an_adapter_equals_the_merged_model(variant, tmp_path):
    """The remaining parity families (llama and qwen2 run above): the paged engine with an adapter
    generates the merged transformers model's greedy tokens (past Mistral's 8-token window)."""
    base_dir, _ = make_hf_model(variant, tmp_path / "base", seed=8)
    _, fresh = make_hf_model(variant, tmp_path / "copy", seed=8)
    merged = write_adapter(fresh, tmp_path / "ad", seed=9, r=8, use_rslora=True).merge_and_unload()
    cfg, weights = load_model(base_dir, make_mesh(1, 1))
    core = make_core(cfg, weights, enable_lora=True, max_loras=1, max_lora_rank=8,
                     lora_modules=(("ad", str(tmp_path / "ad")),))
    out = run_all(core, [Request(f"g{i}", p, greedy(NEW), lora_name="ad") for i, p in enumerate(PROMPTS)])
    assert [out[f"g{i}"][0] for i in range(len(PROMPTS))] == [_hf_greedy(merged, p) for p in PROMPTS]
    assert core.runner.compilations_after_warmup == 0


def test_adapters_with_kv_heads_duplicated_over_a_four_way_model_axis(setup):
    """TP=4 on a 2-KV-head model: the KV heads are duplicated (model/kv_heads.py), and so are the
    adapters' K/V factors; outputs unchanged."""
    core, expected, base_dir = setup
    wide, cfg = _on_model_axis(base_dir, core.engine_cfg.lora_modules, model_axis=4, max_loras=4)
    assert wide.runner.model_cfg.num_kv_heads == 4 and cfg.num_kv_heads == 2
    names = [*ADAPTERS, None]
    _assert_outputs(run_all(wide, _requests("kvdup", names)), "kvdup", names, expected)


def test_an_adapter_read_from_disk_never_holds_up_the_running_steps(setup, tmp_path):
    """max_cpu_loras=2 of 3 adapters: one no longer in host memory is read on a worker thread while the
    running sequences keep stepping (the read is held open until they have stepped 3 times), then
    its request is admitted and gets its merged model's tokens."""
    import threading

    from jaxserve.runner import lora_slots

    core, expected, base_dir = setup
    cfg, weights = load_model(base_dir, make_mesh(1, 1))
    core = make_core(cfg, weights, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2,
                     lora_modules=core.engine_cfg.lora_modules)
    gate, readers = threading.Event(), []
    real = lora_slots.load_adapter

    def slow_read(*args, **kwargs):
        readers.append(threading.current_thread().name)
        if args[-1] == "a2":
            assert gate.wait(30), "the running steps did not go on while the adapter was read"
        return real(*args, **kwargs)

    lora_slots.load_adapter = slow_read
    try:
        core.add_request(Request("first-a1", PROMPTS[0], greedy(NEW), lora_name="a1"))
        while not core.runner.lora.num_loads:
            core.step()
        core.add_request(Request("second-a2", PROMPTS[1], greedy(NEW), lora_name="a2"))
        out: dict[str, list[int]] = {}
        steps = 0
        while core.has_work():
            events = core.step()
            steps += 1
            if steps == 3:
                assert any(e.request_id == "first-a1" for e in events) or out.get("first-a1")
                gate.set()
            for e in events:
                if e.token_id is not None:
                    out.setdefault(e.request_id, []).append(e.token_id)
    finally:
        lora_slots.load_adapter = real
        gate.set()
    assert out["first-a1"] == expected["a1"][0] and out["second-a2"] == expected["a2"][1]
    assert len(readers) == 2 and all(r.startswith("jaxserve-lora-read") for r in readers)  # a1's, a2's


def test_an_adapter_on_a_gemma2_stack_equals_its_merged_transformers_model(tmp_path):
    """LoRA where the family has the target modules: Gemma 2's sandwich norms, soft-caps and
    alternating windows under an adapter on every projection."""
    base_dir, _ = make_hf_model("gemma2", tmp_path / "base", seed=4)
    _, fresh = make_hf_model("gemma2", tmp_path / "copy", seed=4)
    merged = write_adapter(fresh, tmp_path / "a1", seed=1).merge_and_unload()
    cfg, weights = load_model(base_dir, make_mesh(1, 1))
    core = make_core(cfg, weights, enable_lora=True, max_loras=2, max_lora_rank=8,
                     lora_modules=(("a1", str(tmp_path / "a1")),))
    out = run_all(core, [Request(f"r{i}", p, greedy(NEW), lora_name="a1") for i, p in enumerate(PROMPTS)])
    assert [out[f"r{i}"][0] for i in range(len(PROMPTS))] == [_hf_greedy(merged, p) for p in PROMPTS]
