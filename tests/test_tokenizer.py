"""Tokenizer wrapper over the real Qwen vocabulary of `jaxserve-tiny`."""

import copy
from pathlib import Path

import pytest

from jaxserve.default_model import ADDED_TOKENS, NUM_BPE_RANKS, QWEN2_SPLIT_PATTERN, ensure_default_model
from jaxserve.text.tokenizer import ChatTemplateUnavailable, Tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over 13 lazy dogs.",
    "你好，世界。今天天气很好，我们去公园散步吧！龘靐齉爩",
    "Emoji: 👨‍👩‍👧‍👦 🧑🏽‍💻 🏳️‍🌈 🇯🇵🇺🇸 👍🏽 — and a café naïve",
    "def f(x: int) -> int:\n    return x ** 2  # 平方\n\n\tprint(f'{x!r}')\r\n",
    "  leading spaces,   runs   of  spaces\n\n\nand 1234567890 digits",
]


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "jaxserve_cache"


@pytest.fixture(scope="module")
def model_dir(cache_root):
    return ensure_default_model(cache_root)


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < NUM_BPE_RANKS for i in ids)
    assert tok.decode(ids) == text


def test_encoding_matches_tiktoken_with_the_qwen_ranks(tok):
    # The rebuilt HF tokenizer must split text exactly as tiktoken does with the original ranks.
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    from jaxserve.default_model import _qwen_ranks_path

    enc = tiktoken.Encoding("qwen-ref", pat_str=QWEN2_SPLIT_PATTERN,
                            mergeable_ranks=load_tiktoken_bpe(str(_qwen_ranks_path())), special_tokens={})
    for text in TEXTS + ["".join(TEXTS) * 3]:
        assert tok.encode(text, add_special_tokens=False) == enc.encode_ordinary(text)


def test_added_tokens_have_qwen3_ids_and_encode_as_one_token(tok):
    for i, (content, _) in enumerate(ADDED_TOKENS):
        assert tok.encode(content, add_special_tokens=False) == [NUM_BPE_RANKS + i]
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [151644]
    assert tok.encode("<tool_call>", add_special_tokens=False) == [151657]
    assert tok.encode("</think>", add_special_tokens=False) == [151668]
    assert tok.vocab_size == NUM_BPE_RANKS + len(ADDED_TOKENS) == 151669
    assert tok.convert_ids_to_tokens([151644, 9707, 220]) == ["<|im_start|>", "Hello", "Ġ"]


def test_special_ids_eos_and_skipping(tok):
    assert tok.eos_token_ids == frozenset({151645, 151643})
    special = set(tok.all_special_ids)
    assert {151643, 151644, 151645, 151656} <= special
    assert 151667 not in special  # <think> is an added token but not special in Qwen3
    ids = tok.encode("<|im_start|>assistant\nHi<think>x</think><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nHi<think>x</think><|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\nHi<think>x</think>"


def test_chat_template_renders_chatml(tok):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi 👋"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "again"}, {"type": "text", "text": "!"}]},
    ]
    ids = tok.apply_chat_template(messages)
    expected = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                "<|im_start|>user\nSay hi 👋<|im_end|>\n"
                "<|im_start|>assistant\nhi<|im_end|>\n"
                "<|im_start|>user\nagain!<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert tok.decode(ids, skip_special_tokens=False) == expected
    assert ids == tok.encode(expected, add_special_tokens=False)
    assert ids.count(151644) == 5 and ids.count(151645) == 4  # markers are single special tokens
    no_prompt = tok.apply_chat_template(messages[:2], add_generation_prompt=False)
    assert tok.decode(no_prompt, skip_special_tokens=False).endswith("Say hi 👋<|im_end|>\n")


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "must not be empty"),
        ("hello", "must be a list"),
        ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user"}], r"messages\[0\] has no 'content'"),
        ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}], r"messages\[1\] has unknown role 'wizard'"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content is null"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\]\.content\[0\] must be a text part"),
        (["hi"], r"messages\[0\] must be an object"),
    ],
)
def test_malformed_messages_raise_clear_value_errors(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_model_without_chat_template_raises(tok):
    bare = _with_template(tok, None)  # the same tokenizer minus its template
    assert bare.encode("hi", add_special_tokens=False) == [6023]
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.has_chat_template  # the shared one is untouched


def _with_template(tok, template):
    hf = copy.copy(tok.hf)  # a shallow copy: loading a second tokenizer costs seconds
    hf.chat_template = template
    return Tokenizer(hf)


def test_template_rejecting_the_messages_is_a_value_error(tok):
    strict = _with_template(tok, "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn must be "
                                 "the user') }}{% endif %}{{ messages[0]['content'] }}")
    assert strict.decode(strict.apply_chat_template([{"role": "user", "content": "hi"}])) == "hi"
    with pytest.raises(ValueError, match="first turn must be the user"):
        strict.apply_chat_template([{"role": "system", "content": "x"}])
    # Fields of the wrong shape reach the template: jinja's UndefinedError, a TypeError.
    calls = _with_template(tok, "{{ messages[0]['tool_calls'][0]['function']['name'].upper() }}"
                                "{{ messages[0]['tool_calls'] | length }}")
    for tool_calls in ("oops", 5):
        with pytest.raises(ValueError, match="chat template failed"):
            calls.apply_chat_template([{"role": "assistant", "content": "x", "tool_calls": tool_calls}])


def test_template_failure_that_is_not_the_messages_fault_is_not_a_value_error(tok):
    """transformers raises ImportError when jinja2 is missing; a template that does not compile is
    the model's fault. Neither may read as a client error (ValueError -> 400)."""
    def no_jinja(*args, **kwargs):
        raise ImportError("apply_chat_template requires jinja2 to be installed.")

    without_jinja = copy.copy(tok.hf)
    without_jinja.apply_chat_template = no_jinja
    with pytest.raises(ChatTemplateUnavailable, match="ImportError: apply_chat_template requires jinja2") as exc:
        Tokenizer(without_jinja).apply_chat_template([{"role": "user", "content": "hi"}])
    assert not isinstance(exc.value, ValueError)
    broken = _with_template(tok, "{% if messages %}never closed")
    with pytest.raises(ChatTemplateUnavailable, match="TemplateSyntaxError"):
        broken.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_model_dir_and_bad_text_raise(tmp_path, tok):
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match="must be a str"):
        tok.encode(b"bytes")


def test_a_draft_with_another_vocabulary_is_named_and_the_same_one_passes(tmp_path):
    """Speculative draft_model check (engine/loading.load_engine_core): the real Qwen vocabulary against itself
    passes; one token renamed, or an added token moved, is an error naming both directories."""
    import json

    from jaxserve.default_model import ensure_default_model
    from jaxserve.text.tokenizer import check_same_vocabulary

    qwen = Path(ensure_default_model())
    check_same_vocabulary(qwen, qwen)
    spec = json.loads((qwen / "tokenizer.json").read_text())
    renamed = json.loads(json.dumps(spec))
    renamed["model"]["vocab"]["hello!"] = renamed["model"]["vocab"].pop("hello")
    moved = json.loads(json.dumps(spec))
    moved["added_tokens"][0]["id"] += 1
    for i, variant in enumerate((renamed, moved)):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "tokenizer.json").write_text(json.dumps(variant))
        with pytest.raises(ValueError, match=f"draft model {d} has another vocabulary than the target {qwen}"):
            check_same_vocabulary(qwen, d)
    check_same_vocabulary(qwen, tmp_path)  # no tokenizer.json there: left to the vocab-size check


def test_qwen_tokenizers_load_as_written_and_equal_transformers_own_class(model_dir, tok, tmp_path):
    """Qwen2Tokenizer checkpoints load through the generic fast tokenizer (tokenizer.json read in
    Rust, not rebuilt from Python-parsed JSON): the same ids, text, tokens, special tokens and chat
    rendering as transformers' Qwen2Tokenizer. Another class still loads through AutoTokenizer."""
    import json
    import shutil

    import numpy as np
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    assert type(own).__name__ == "Qwen2Tokenizer" and type(tok.hf).__name__ != "Qwen2Tokenizer"
    marked = "<|im_start|>user\nhi <tool_call>{}</tool_call><|im_end|><|endoftext|>"
    for text in [*TEXTS, marked]:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == own.encode(text, add_special_tokens=special)
    ids = np.random.default_rng(0).integers(0, len(own), 2000).tolist() + sorted(own.all_special_ids)
    assert tok.convert_ids_to_tokens(ids) == own.convert_ids_to_tokens(ids)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == own.decode(ids, skip_special_tokens=skip)
    assert (len(tok.hf), tok.hf.all_special_ids, tok.hf.get_added_vocab(), tok.hf.eos_token_id) == (
        len(own), own.all_special_ids, own.get_added_vocab(), own.eos_token_id)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert tok.apply_chat_template(messages, tools=tools) == own.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)

    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    assert type(Tokenizer.from_pretrained(other).hf).__name__ == "GPT2Tokenizer"


def test_llguidance_reads_the_same_vocabulary_as_its_own_loader(tok):
    """GrammarCompiler hands llguidance the tokenizer's JSON without the copy its from_tokenizer
    makes: every token's bytes, the special tokens and the EOS set are the same."""
    import llguidance.hf

    from jaxserve.structured.compiler import GrammarCompiler

    ours = GrammarCompiler(tok.hf, 151936, tok.eos_token_ids).tokenizer
    theirs = llguidance.hf.from_tokenizer(tok.hf, n_vocab=151936, eos_token=sorted(tok.eos_token_ids))
    assert ours.vocab_size == theirs.vocab_size == 151936 and ours.eos_tokens == theirs.eos_tokens
    every = list(range(len(tok.hf)))
    assert [ours.decode_bytes([i]) for i in every] == [theirs.decode_bytes([i]) for i in every]
    assert [ours.is_special_token(i) for i in every] == [theirs.is_special_token(i) for i in every]
    assert ours.tokenize_str(TEXTS[2]) == theirs.tokenize_str(TEXTS[2])
