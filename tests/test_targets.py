"""Deployment targets (targets.py) and sharding layouts (layouts.py): parsing, compile-only
devices, and errors that name the problem."""

from __future__ import annotations

import importlib.util

import pytest

from jaxserve.planning import targets
from jaxserve.core.config import ModelConfig
from jaxserve.parallel.layouts import candidate_layouts, check_divides, make_layout
from jaxserve.planning.targets import CHIPS, TargetUnavailable, parse_target

CFG = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
                           "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
                           "num_key_value_heads": 2, "max_position_embeddings": 512})


@pytest.mark.parametrize("text,name,devices", [
    ("tpu-v6e:2x2", "tpu-v6e:2x2", 4), ("TPU-v5e:2x4", "tpu-v5e:2x4", 8), ("tpu-v5p:2x2x1", "tpu-v5p:2x2x1", 4),
    ("tpu-trillium:1x1", "tpu-v6e:1x1", 1), ("gpu-h100:1x1x8", "gpu-h100:1x1x8", 8), ("cpu", "cpu:1", 1),
    ("cpu:8", "cpu:8", 8)])
def test_parse_target_names_and_device_counts(text, name, devices):
    target = parse_target(text)
    assert (target.name, target.num_devices) == (name, devices)


@pytest.mark.parametrize("text,message", [
    ("tpu-v9z:2x2", "unknown TPU chip 'v9z'"), ("gpu-v6e:1x1x1", "unknown GPU chip"),
    ("a100", "valid targets look like: tpu-v5e:2x2"), ("gpu-h100:8", "SLICESxHOSTSxGPUS"),
    ("tpu-v5p:2x2", "v5p slices are 3-D"), ("tpu-v6e:0x2", "empty dimension"), ("cpu:x", "cpu or cpu:N")])
def test_bad_targets_name_the_problem_and_list_the_valid_ones(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as e:
        parse_target(text)
    if "valid" in message or "unknown" in message:
        assert "tpu-v6e:2x2" in str(e.value)


@pytest.mark.parametrize("text", ["tpu-v6e:2x2", "tpu-v5e:2x2", "tpu-v5p:2x2x1", "tpu-v6e:1x1", "tpu-v6e:4x4"])
def test_tpu_targets_give_compile_only_devices_of_their_chip(text):
    target = parse_target(text)
    devices = target.devices()
    assert len(devices) == target.num_devices
    assert {d.platform for d in devices} == {"tpu"}
    assert {d.device_kind for d in devices} == {target.chip.device_kind}  # the chip table names jax's kind


def test_multi_host_tpu_slices_span_processes():
    assert len({d.process_index for d in parse_target("tpu-v6e:4x4").devices()}) == 4  # 4 hosts of 2x2


def test_missing_libtpu_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(targets.importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    with pytest.raises(TargetUnavailable, match=r"pip install 'jaxserve\[tpu\]'"):
        parse_target("tpu-v6e:2x2").devices()


def test_cpu_target_uses_this_machine():
    target = parse_target("cpu:8")
    assert len(target.devices()) == 8 and target.chip.hbm_bytes > 0
    with pytest.raises(ValueError, match="needs 64 CPU devices"):
        parse_target("cpu:64").devices()


def test_chip_table_figures_are_per_chip_and_sourced():
    for chip in CHIPS.values():
        assert chip.hbm_bytes > 2**30 and chip.hbm_bandwidth > 1e11 and chip.flops("bfloat16") > 1e14
        assert chip.source
    assert CHIPS["v6e"].flops("float32") == CHIPS["v6e"].flops("bfloat16") / 3  # emulated in 3 bf16 passes
    assert CHIPS["h100"].flops("float32") == 67e12


def test_layout_that_does_not_divide_names_the_dimension():
    with pytest.raises(ValueError, match="TP=3 does not divide the 8 query heads"):
        check_divides(make_layout("tp", 3), CFG)
    odd_mlp = ModelConfig.from_hf({**_raw(), "intermediate_size": 500})
    with pytest.raises(ValueError, match="TP=8 does not divide the 500 MLP width"):
        check_divides(make_layout("tp", 8), odd_mlp)
    with pytest.raises(ValueError, match="does not divide the target's 8 devices"):
        make_layout("tp", 8, 3)
    with pytest.raises(ValueError, match="unknown layout 'zigzag'; known: tp, tp-vocab-replicated, tp-kv-replicated"):
        make_layout("zigzag", 4)


def test_kv_heads_fewer_than_tp_are_duplicated_or_replicated_and_said():
    assert check_divides(make_layout("tp", 2), CFG) == []
    (note,) = check_divides(make_layout("tp", 4), CFG)
    assert "2 KV heads duplicated 2x to 4: one per device" in note
    (note,) = check_divides(make_layout("tp-kv-replicated", 4), CFG)
    assert "2 KV heads whole on every device" in note
    three_kv = ModelConfig.from_hf({**_raw(), "num_attention_heads": 12, "num_key_value_heads": 3})
    (note,) = check_divides(make_layout("tp", 4), three_kv)   # 4 is not a multiple of 3: replicated
    assert "3 KV heads whole on every device" in note


def test_candidate_layouts_cover_tp_sizes_and_rule_sets_that_divide():
    names = [layout.name for layout in candidate_layouts(CFG, 8)]
    assert names == ["tp dp=8 tp=1", "tp dp=4 tp=2", "tp dp=2 tp=4", "tp dp=1 tp=8",
                     "tp-vocab-replicated dp=4 tp=2", "tp-vocab-replicated dp=2 tp=4",
                     "tp-vocab-replicated dp=1 tp=8",
                     "tp-kv-replicated dp=4 tp=2", "tp-kv-replicated dp=2 tp=4", "tp-kv-replicated dp=1 tp=8"]
    six_heads = ModelConfig.from_hf({**_raw(), "num_attention_heads": 6, "num_key_value_heads": 2})
    assert [lay.tp for lay in candidate_layouts(six_heads, 4) if lay.rules_name == "tp"] == [1, 2]


def _raw() -> dict:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
            "max_position_embeddings": 512}


def test_plan_help_names_every_rule_set():
    from jaxserve.entrypoints import cli
    from jaxserve.parallel.layouts import RULE_SETS
    plan = cli.build_parser()._subparsers._group_actions[0].choices["plan"]
    help_text = "".join(plan.format_help().split())  # argparse wraps lines at hyphens
    assert all(name in help_text for name in RULE_SETS)
