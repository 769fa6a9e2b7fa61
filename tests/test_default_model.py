"""The embedded `jaxserve-tiny` directory: written once, ordinary HF format, loadable by transformers."""

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from own_process import child_env

from jaxserve.default_model import (
    ADDED_TOKENS,
    CONFIG,
    MODEL_NAME,
    default_cache_dir,
    ensure_default_model,
    random_weights,
    weight_shapes,
)


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory):
    # Shared with the tokenizer/detokenizer test files: built once per session, reused after.
    return tmp_path_factory.getbasetemp() / "jaxserve_cache"


_BUILD_WITHOUT_TORCH = (
    "import sys, pathlib\n"
    "class _Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'torch' or name.startswith('torch.'):\n"
    "            raise ImportError('torch is blocked in this test')\n"
    "sys.meta_path.insert(0, _Block())\n"
    "from jaxserve.default_model import ensure_default_model\n"
    "print(ensure_default_model(pathlib.Path(sys.argv[1])))\n"
    "assert 'torch' not in sys.modules\n"
)


@pytest.fixture(scope="session")
def fresh_build(cache_root, tmp_path_factory):
    """Build into a cache root that holds a partial `jaxserve-tiny` dir, in a torch-less interpreter.

    Uses the shared root when nothing is there yet (so the session builds only once).
    """
    root = cache_root if not cache_root.exists() else tmp_path_factory.mktemp("jaxserve_cache_fresh")
    partial = root / MODEL_NAME
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")  # no completion marker: as if a writer crashed
    done = subprocess.run([sys.executable, "-c", _BUILD_WITHOUT_TORCH, str(root)], env=child_env(),
                          timeout=300, capture_output=True, text=True)
    return root, done


@pytest.fixture(scope="session")
def model_dir(fresh_build, cache_root):
    return ensure_default_model(cache_root)


def test_builds_without_torch_and_replaces_a_partial_directory(fresh_build):
    root, done = fresh_build
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(root / MODEL_NAME)
    built = root / MODEL_NAME
    assert json.loads((built / "config.json").read_text())["model_type"] == "qwen3"
    assert (built / "model.safetensors").stat().st_size > 150_000_000
    # Only the model dir remains: no temp or stale directories left behind.
    assert sorted(p.name for p in root.iterdir()) == [MODEL_NAME]


def test_directory_has_hf_files_and_says_weights_are_random(model_dir, cache_root):
    assert model_dir == cache_root / MODEL_NAME
    for name in ["config.json", "generation_config.json", "model.safetensors",
                 "tokenizer.json", "tokenizer_config.json", "README.md"]:
        assert (model_dir / name).is_file(), name
    assert "weights in this directory are random" in (model_dir / "README.md").read_text()
    import jaxserve.default_model as dm
    assert "RANDOM weights" in dm.__doc__


def test_config_and_generation_config(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    expected = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, vocab_size=151936, max_position_embeddings=4096,
                    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                    attention_bias=False, hidden_act="silu", dtype="float32",
                    bos_token_id=151643, eos_token_id=151645)
    assert {k: cfg[k] for k in expected} == expected
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643]


def test_second_call_reuses_directory_without_rewriting(model_dir, cache_root, monkeypatch):
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(cache_root) == model_dir
    # $JAXSERVE_CACHE is the default root.
    monkeypatch.setenv("JAXSERVE_CACHE", str(cache_root))
    assert default_cache_dir() == cache_root
    assert ensure_default_model() == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_default_cache_dir_without_env(monkeypatch, tmp_path):
    monkeypatch.delenv("JAXSERVE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "jaxserve"


def test_weights_names_shapes_and_values(model_dir):
    w = load_file(str(model_dir / "model.safetensors"))
    shapes = weight_shapes(CONFIG)
    assert {k: v.shape for k, v in w.items()} == shapes
    assert "lm_head.weight" not in w  # tied to the embedding
    assert w["model.layers.0.self_attn.q_proj.weight"].shape == (256, 256)
    assert w["model.layers.3.self_attn.k_proj.weight"].shape == (128, 256)
    assert w["model.layers.1.mlp.down_proj.weight"].shape == (256, 768)
    assert all(v.dtype == np.float32 for v in w.values())
    for name, v in w.items():
        if name.endswith("norm.weight"):
            assert np.all(v == 1.0), name
    emb = w["model.embed_tokens.weight"]
    assert abs(float(emb.std()) - 0.02) < 1e-3 and abs(float(emb.mean())) < 1e-3
    # Seeded: the file holds exactly what random_weights() draws (seed 0).
    again = random_weights(CONFIG, seed=0)
    np.testing.assert_array_equal(w["model.layers.2.mlp.gate_proj.weight"], again["model.layers.2.mlp.gate_proj.weight"])
    np.testing.assert_array_equal(emb[:8], again["model.embed_tokens.weight"][:8])


def test_tokenizer_config_lists_qwen3_added_tokens(model_dir):
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    decoder = tc["added_tokens_decoder"]
    assert decoder["151643"]["content"] == "<|endoftext|>"
    assert decoder["151644"]["content"] == "<|im_start|>"
    assert decoder["151645"]["content"] == "<|im_end|>"
    assert decoder["151657"]["content"] == "<tool_call>"
    assert decoder["151668"]["content"] == "</think>"
    assert len(decoder) == len(ADDED_TOKENS) == 26
    assert "<|im_start|>" in tc["chat_template"]


def test_transformers_autoconfig_loads(model_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    assert cfg.model_type == "qwen3"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (256, 4, 2, 64)
    assert cfg.rope_parameters["rope_theta"] == 1000000.0
    assert cfg.tie_word_embeddings is True


def test_transformers_loads_weights_into_qwen3_and_gives_finite_logits(model_dir):
    import torch  # the test extra's oracle
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)
    model.eval()
    w = load_file(str(model_dir / "model.safetensors"))
    # The checkpoint's tensors were loaded (not freshly initialised), and the head is tied.
    got = model.model.layers[1].self_attn.v_proj.weight.detach().numpy()
    np.testing.assert_array_equal(got, w["model.layers.1.self_attn.v_proj.weight"])
    np.testing.assert_array_equal(model.lm_head.weight.detach().numpy(), w["model.embed_tokens.weight"])
    with torch.no_grad():
        logits = model(torch.tensor([[151644, 872, 198, 9707, 151645]])).logits
    assert logits.shape == (1, 5, 151936)
    assert torch.isfinite(logits).all()
    assert float(logits.std()) > 0.0


# ---------------------------------------------------------------- chat template: tools and thinking

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
CALL_FORMAT = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'


@pytest.fixture(scope="module")
def hf_tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def render(hf_tok, messages, **kw):
    kw.setdefault("add_generation_prompt", True)
    return hf_tok.apply_chat_template(messages, tokenize=False, **kw)


def test_template_is_current_and_written(model_dir):
    import jaxserve.default_model as dm

    assert dm.FORMAT_VERSION == "2"
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"] == dm.CHAT_TEMPLATE
    assert "tool_call" in (model_dir / "README.md").read_text()


def test_template_without_tools_is_plain_chatml(hf_tok):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    expected = ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n")
    assert render(hf_tok, messages, add_generation_prompt=False) == expected
    assert render(hf_tok, messages) == expected + "<|im_start|>assistant\n"
    assert render(hf_tok, messages, tools=[]) == expected + "<|im_start|>assistant\n"
    assert render(hf_tok, messages, enable_thinking=True) == expected + "<|im_start|>assistant\n"
    no_thinking = expected + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert render(hf_tok, messages, enable_thinking=False) == no_thinking
    assert render(hf_tok, messages, add_generation_prompt=False, enable_thinking=False) == expected


def test_template_lists_tools_in_a_system_turn(hf_tok):
    user = {"role": "user", "content": "Weather in Köln?"}
    text = render(hf_tok, [user], tools=[TOOL], enable_thinking=False)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOL, ensure_ascii=False) + "\n</tools>" in system
    assert system.endswith(CALL_FORMAT)
    assert rest == "<|im_start|>user\nWeather in Köln?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # The user's system message opens the same system turn; it is not repeated.
    with_system = render(hf_tok, [{"role": "system", "content": "Be terse."}, user], tools=[TOOL, TOOL])
    assert with_system.startswith("<|im_start|>system\nBe terse.\n\n# Tools\n")
    assert with_system.count("<|im_start|>system") == 1 and with_system.count("Be terse.") == 1
    assert with_system.count(json.dumps(TOOL)) == 2
    assert with_system.endswith("<|im_start|>user\nWeather in Köln?<|im_end|>\n<|im_start|>assistant\n")


def test_template_renders_tool_calls_and_tool_responses(hf_tok):
    messages = [
        {"role": "user", "content": "Paris and Köln?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Köln"}}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": "Checking again.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {}}}]},
        {"role": "tool", "content": "still rain"},
        {"role": "user", "content": "thanks"},
    ]
    text = render(hf_tok, messages, tools=[TOOL])
    turns = text.split("<|im_end|>\n")
    assert turns[1:] == [
        "<|im_start|>user\nParis and Köln?",
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>',
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>",
        '<|im_start|>assistant\nChecking again.\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
        "<|im_start|>user\n<tool_response>\nstill rain\n</tool_response>",
        "<|im_start|>user\nthanks",
        "<|im_start|>assistant\n",
    ]


def test_rendered_tool_calls_parse_back_with_the_hermes_parser(hf_tok):
    # What the template teaches is what the server parses.
    from jaxserve.server.tools import HermesToolParser

    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "n": [1, 2]}}},
             {"type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]
    text = render(hf_tok, [{"role": "user", "content": "q"},
                           {"role": "assistant", "content": "Let me see.", "tool_calls": calls}],
                  add_generation_prompt=False)
    answer = text.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    content, parsed = HermesToolParser([TOOL]).parse(answer)
    assert content == "Let me see."
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [
        ("get_weather", {"city": "Paris", "n": [1, 2]}), ("get_time", {"tz": "UTC"})]
    assert parsed[0].arguments == '{"city": "Paris", "n": [1, 2]}'
