"""Tool calling pieces: request validation, the parser registry, the Hermes format (parsing, streaming,
forced-call grammars checked with llguidance on the real Qwen vocabulary and on vocabularies that
hold the tags as special tokens or not at all), and how the tags meet a vocabulary (tags.py)."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.server.tools import (
    DEFAULT_TOOL_PARSER,
    TOOL_PARSERS,
    HermesToolParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
    new_tool_call_id,
    validate_parallel_tool_calls,
    validate_tool_choice,
    validate_tools,
)
from jaxserve.server.tools.base import arguments_schema
from jaxserve.server.tools.call_scanner import CallScanner
from jaxserve.server.tools.tags import ToolTags

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


# ---------------------------------------------------------------- validation


def test_validate_tools_normalises():
    raw = [{"type": "function", "function": {"name": "a-b_1", "description": None, "parameters": {"type": "object"},
                                             "strict": True}},
           {"type": "function", "function": {"name": "x"}}]
    assert validate_tools(raw) == [
        {"type": "function", "function": {"name": "a-b_1", "parameters": {"type": "object"}, "strict": True}},
        {"type": "function", "function": {"name": "x"}}]
    assert validate_tools(None) == [] and validate_tools([]) == []
    assert validate_tools(TOOLS) == TOOLS


@pytest.mark.parametrize("value, message", [
    ({"type": "function"}, r"^tools must be a list"),
    (["f"], r"^tools\[0\] must be an object"),
    ([{"function": {"name": "f"}}], r"^tools\[0\]\.type must be 'function'"),
    ([{"type": "code_interpreter"}], r"^tools\[0\]\.type must be 'function'"),
    ([{"type": "function", "function": {"name": "f"}, "extra": 1}], r"^tools\[0\] has unknown field 'extra'"),
    ([{"type": "function"}], r"^tools\[0\]\.function must be an object"),
    ([TIME, {"type": "function", "function": {"name": "bad name"}}], r"^tools\[1\]\.function\.name must be"),
    ([{"type": "function", "function": {"name": "x" * 65}}], r"^tools\[0\]\.function\.name must be"),
    ([{"type": "function", "function": {"name": ""}}], r"^tools\[0\]\.function\.name must be"),
    ([{"type": "function", "function": {"name": 3}}], r"^tools\[0\]\.function\.name must be"),
    ([{"type": "function", "function": {}}], r"^tools\[0\]\.function\.name must be"),
    ([{"type": "function", "function": {"name": "f", "description": 1}}], r"^tools\[0\]\.function\.description"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], r"^tools\[0\]\.function\.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     r"^tools\[0\]\.function\.parameters must describe an object"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], r"^tools\[0\]\.function\.strict"),
    ([{"type": "function", "function": {"name": "f", "nme": "g"}}], r"^tools\[0\]\.function has unknown field"),
    ([TIME, WEATHER, TIME], r"^tools\[2\]\.function\.name 'get_time' repeats the name of tools\[0\]"),
])
def test_validate_tools_errors_name_the_path(value, message):
    with pytest.raises(ValueError, match=message):
        validate_tools(value)


def test_validate_tool_choice():
    named = {"type": "function", "function": {"name": "get_time"}}
    assert validate_tool_choice(None, TOOLS) == "auto"
    assert validate_tool_choice(None, []) == "none" and validate_tool_choice(None, None) == "none"
    for mode in ("none", "auto", "required"):
        assert validate_tool_choice(mode, TOOLS) == mode
    assert validate_tool_choice("none", None) == "none"
    assert validate_tool_choice(named, TOOLS) == named
    assert validate_tool_choice({**named, "function": {"name": "get_time", "x": 1}}, TOOLS) == named


@pytest.mark.parametrize("value, tools, message", [
    ("sometimes", TOOLS, r"^tool_choice must be one of"),
    (3, TOOLS, r"^tool_choice must be a string or an object"),
    ({"type": "tool", "function": {"name": "get_time"}}, TOOLS, r"^tool_choice\.type must be 'function'"),
    ({"type": "function"}, TOOLS, r"^tool_choice\.function must be an object"),
    ({"type": "function", "function": {"name": "x"}}, TOOLS, r"^tool_choice names function 'x', which is not in tools"),
    ({"type": "function", "function": {"name": "x"}}, [], r"^tool_choice names function 'x'"),
    ("required", [], r"^tool_choice 'required' needs"),
    ("required", None, r"^tool_choice 'required' needs"),
])
def test_validate_tool_choice_errors(value, tools, message):
    with pytest.raises(ValueError, match=message):
        validate_tool_choice(value, tools)


def test_validate_parallel_tool_calls():
    assert validate_parallel_tool_calls(None) is True
    assert validate_parallel_tool_calls(False) is False
    with pytest.raises(ValueError, match="^parallel_tool_calls must be a boolean"):
        validate_parallel_tool_calls("false")


# ---------------------------------------------------------------- registry and records


def test_registry():
    assert TOOL_PARSERS == {"hermes": HermesToolParser}
    assert DEFAULT_TOOL_PARSER in TOOL_PARSERS
    assert get_tool_parser("hermes") is HermesToolParser and HermesToolParser.name == "hermes"
    assert issubclass(HermesToolParser, ToolParser)
    with pytest.raises(ValueError, match=r"unknown tool-call parser 'mistral'; known parsers: hermes"):
        get_tool_parser("mistral")


def test_call_ids_are_fresh_and_openai_shaped():
    ids = {new_tool_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


# ---------------------------------------------------------------- Hermes: whole text


def parse(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = HermesToolParser(TOOLS).parse(text)
    for c in calls:
        assert isinstance(c, ToolCall) and re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id)
    return content, [(c.name, c.arguments) for c in calls]


def test_parse_one_call_with_text_before():
    text = 'Let me look.\n' + call("get_weather", '{"city": "Paris"}')
    assert parse(text) == ("Let me look.", [("get_weather", '{"city": "Paris"}')])
    assert parse(call("get_weather", '{"city": "Paris"}') + "\n") == (None, [("get_weather", '{"city": "Paris"}')])


def test_parse_parallel_calls_and_text_between():
    text = (call("get_weather", '{"city": "Paris"}') + "\n" + call("get_time", "{}") + "\nand also\n"
            + call("get_weather", '{"city":"Köln" ,"x" : [1, {"y": "}{\\"]"}]}'))
    assert parse(text) == ("and also", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}"),
                                        ("get_weather", '{"city":"Köln" ,"x" : [1, {"y": "}{\\"]"}]}')])


def test_parse_arguments_are_the_raw_text_stripped():
    # Key order, spacing and escapes stay as the model wrote them; the surrounding whitespace goes.
    text = '<tool_call>  {"arguments"  :\n {"b": 1,\n "a": "\\u00e9"} ,"name":"get_time", "id": 7}  </tool_call>'
    assert parse(text) == (None, [("get_time", '{"b": 1,\n "a": "\\u00e9"}')])
    assert parse('<tool_call>{"name": "get_time"}</tool_call>') == (None, [("get_time", "{}")])
    assert parse('<tool_call>{"name": "get_\\u0074ime", "arguments": {}}</tool_call>') == (None, [("get_time", "{}")])


@pytest.mark.parametrize("block", [
    '<tool_call>\n{"name": "get_time", "arguments": {}\n</tool_call>',            # unbalanced
    '<tool_call>\n{"arguments": {}}\n</tool_call>',                               # no name
    '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',                    # name not a string
    '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>',      # arguments not an object
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"x": tru}}\n</tool_call>',          # bad literal
    '<tool_call>\n{"name": "f", "name": "g", "arguments": {}}\n</tool_call>',     # repeated key
    '<tool_call>\n[{"name": "f", "arguments": {}}]\n</tool_call>',                # not an object
    '<tool_call>\n{"name": "f", "arguments": {}} extra\n</tool_call>',
    '<tool_call>\nI will call get_time.\n</tool_call>',
    '<tool_call></tool_call>',
])
def test_malformed_block_is_content_verbatim(block):
    for text in (block, "Hi! " + block + " bye", "a\n\n" + block + "\n\nb"):
        assert parse(text) == (text, [])
    # A valid call next to it still counts; whitespace around the valid one is dropped.
    text = block + "\n" + call("get_time", "{}")
    assert parse(text) == (block, [("get_time", "{}")])


def test_block_cut_off_by_max_tokens():
    done = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n'
    assert parse("ok " + done) == ("ok", [("get_time", '{"tz": "UTC"}')])
    assert parse(done + "</tool_") == (None, [("get_time", '{"tz": "UTC"}')])
    cut = 'ok <tool_call>\n{"name": "get_time", "arguments": {"tz": "UT'
    assert parse(cut) == (cut, [])
    assert parse("<tool_call>") == ("<tool_call>", [])


def test_text_without_calls_is_unchanged():
    for text in ["plain", "  spaced \n\n", "<tool_", "a <tool_call b", "</tool_call> x", "\n<tool_response>x"]:
        assert parse(text) == (text, [])
    assert parse("") == (None, [])


def test_closing_tag_ends_a_block_even_inside_a_string():
    text = '<tool_call>\n{"name": "f", "arguments": {"s": "</tool_call>"}}\n</tool_call>'
    content, calls = parse(text)
    assert calls == [] and content == text


# ---------------------------------------------------------------- Hermes: streaming


def stream(chunks: list[str], parser: HermesToolParser | None = None) -> tuple[str, list[ToolCallDelta]]:
    parser = parser or HermesToolParser(TOOLS)
    content, deltas = [], []
    for chunk in chunks + [None]:
        c, d = parser.feed(chunk) if chunk is not None else parser.finish()
        assert isinstance(c, str)
        content.append(c)
        deltas.extend(d)
    return "".join(content), deltas


def assembled(deltas: list[ToolCallDelta]) -> list[tuple[str, str]]:
    """Checks the OpenAI delta shape and returns [(name, arguments)] by index."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.index == len(calls), "calls are numbered 0, 1, ... in order"
            assert re.fullmatch(r"call_[A-Za-z0-9]{24}", d.id or "") and d.name, d
            calls[d.index] = [d.name, d.arguments]
        else:
            assert d.id is None and d.name is None and d.arguments, d
            calls[d.index][1] += d.arguments
    return [(n, a) for n, a in calls.values()]


def cuts(text: str, points: list[int]) -> list[str]:
    points = sorted(set(p for p in points if 0 < p < len(text)))
    edges = [0] + points + [len(text)]
    return [text[a:b] for a, b in zip(edges, edges[1:])]


# Texts where streaming and parse must agree exactly (no block breaks after its call was announced).
STREAM_TEXTS = [
    'Let me look.\n\n' + call("get_weather", '{"city": "Paris"}'),
    call("get_weather", '{"city": "Paris"}') + "\n" + call("get_time", "{}") + "\n",
    '<tool_call>\n{"arguments": {"s": "a\\"}<b", "n": [1, 2, {"k": null}]}, "name": "get_weather"}\n</tool_call>',
    'x <tool_call>{"name": "get_time"}</tool_call> y <tool_ <tool_call>\n{"name": "é", "arguments": {"z": "ü"}}',
    "no calls at all, but a < and a </ and <tool and trailing space  \n",
    '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call> then ' + call("get_time", '{"a": 1}'),
    'a<tool_call>bad</tool_call>\n\n' + call("get_time", "{}") + "\n\n<tool_call>\n{\"name\":",
    # broken before the name: never announced, so content for streaming as for parse
    '<tool_call>\n{"arguments": {x}, "name": "get_weather"}\n</tool_call> ' + call("get_time", "{}"),
    '<tool_call>{"arguments": {"a": 01}, "name": "get_time"}</tool_call>',
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streaming_matches_parse_for_every_single_and_double_cut(text):
    content, calls = parse(text)
    expected = (content or "", calls)
    assert (stream([text])[0], assembled(stream([text])[1])) == expected
    assert (stream(list(text))[0], assembled(stream(list(text))[1])) == expected  # one character at a time
    n = len(text)
    for i in range(1, n):
        got, deltas = stream(cuts(text, [i]))
        assert (got, assembled(deltas)) == expected, i
    for i in range(1, n, 3):
        for j in range(i + 1, n, 5):
            got, deltas = stream(cuts(text, [i, j]))
            assert (got, assembled(deltas)) == expected, (i, j)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(STREAM_TEXTS), st.lists(st.integers(min_value=1, max_value=200), max_size=40))
def test_streaming_matches_parse_for_random_chunkings(text, points):
    content, calls = parse(text)
    got, deltas = stream(cuts(text, points))
    assert (got, assembled(deltas)) == (content or "", calls)


def test_arguments_stream_before_the_block_ends():
    p = HermesToolParser(TOOLS)
    assert p.feed("Sure.\n<tool_") == ("Sure.", [])               # the partial tag is held back
    assert p.feed("call>\n") == ("", [])
    content, [first] = p.feed('{"name": "get_weather", "arguments": {"ci')
    assert content == "" and (first.index, first.name, first.arguments) == (0, "get_weather", '{"ci')
    assert p.feed('ty": "Pa') == ("", [ToolCallDelta(0, None, None, 'ty": "Pa')])
    assert p.feed('ris"}}\n</tool') == ("", [ToolCallDelta(0, None, None, 'ris"}')])
    assert p.feed("_call>\n\n") == ("", [])
    assert p.feed("<tool_call>\n") == ("", [])
    _, deltas = p.feed('{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(1, "get_time", "{}")]
    assert deltas[0].id != first.id
    assert p.finish() == ("", [])


def test_name_after_arguments_waits_for_the_name():
    p = HermesToolParser(TOOLS)
    assert p.feed('<tool_call>{"arguments": {"city": "Rome"}, ') == ("", [])
    _, deltas = p.feed('"name": "get_weather"}</tool_call>')
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", '{"city": "Rome"}')]


def test_tags_split_across_chunks_never_leak():
    text = "ab " + call("get_time", "{}") + " cd"
    for size in range(1, 8):
        chunks = [text[i:i + size] for i in range(0, len(text), size)]
        p = HermesToolParser(TOOLS)
        for chunk in chunks:
            c, _ = p.feed(chunk)
            assert "<" not in c and ">" not in c and "tool" not in c
        assert stream(chunks)[0] == "abcd"


def test_streaming_commits_early_and_documents_the_difference():
    # Once the name is out and the arguments have begun, a block that later breaks stays a call
    # with what was streamed; parse() returns such a block as content.
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    for chunks in ([broken], list(broken)):
        content, deltas = stream(chunks)
        assert (content, assembled(deltas)) == ("", [("get_weather", '{"city": "Par')])
    assert parse(broken) == (broken, [])
    unclosed = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'
    assert assembled(stream([unclosed])[1]) == [("get_weather", '{"city": "Paris"}')]
    assert parse(unclosed) == (unclosed, [])
    # Before that point nothing is announced, so streaming and parse agree.
    early = '<tool_call>\n{"name": "get_weather", "argu'
    assert stream(list(early)) == (early, []) and parse(early) == (early, [])


def test_arguments_stop_streaming_where_they_stop_being_json():
    # Committed, the call keeps what was valid; the character that breaks the JSON and all after it
    # are dropped (they were streamed before).
    for bad, kept in [(' x, "n": 1}}', ' '), ('1}}', ''), (', }}', ', '), ('}, "name": "again"}', '}')]:
        text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' + bad + "\n</tool_call>"
        for chunks in ([text], list(text)):
            content, deltas = stream(chunks)
            assert (content, assembled(deltas)) == ("", [("get_weather", '{"city": "Paris"' + kept)]), (bad, chunks)
        assert parse(text) == (text, [])


@settings(max_examples=400, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=8),
       st.integers(min_value=0, max_value=10_000), st.sampled_from(list('x,:}]{["0-.e+tn\\ \n\x01')))
def test_scanner_rejects_exactly_what_json_rejects(value, where, char):
    """A call's JSON with one character replaced: the scanner finds an error iff json.loads does,
    and never before the first character where the text stops being a beginning of valid JSON."""
    good = json.dumps({"name": "f", "arguments": {"v": value}}, indent=where % 3 or None)
    i = where % len(good)
    text = good[:i] + char + good[i + 1:]
    scanner = CallScanner()
    scanner.feed(good)
    assert not scanner.error and scanner.closed and scanner.result(good) is not None
    scanner = CallScanner()
    scanner.feed(text)
    try:
        json.loads(text)
        valid = True
    except ValueError:
        valid = False
    assert (not scanner.error and scanner.closed) == valid, text
    prefix = CallScanner()
    prefix.feed(text[:i])
    assert not prefix.error, text[:i]  # the unchanged beginning is never refused


def test_a_call_cut_by_max_tokens_never_leaks_its_markup():
    # Announced: a call with the arguments written so far; not yet announced: dropped, not content.
    announced = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    unannounced = 'Sure. <tool_call>\n{"name": "get_wea'
    p = HermesToolParser(TOOLS)
    content, calls = p.parse_as_streamed(announced, truncated=True)
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Par')]
    assert p.parse_as_streamed(unannounced, truncated=True) == ("Sure.", [])
    assert p.parse_as_streamed(unannounced) == (unannounced, [])  # a stop inside one: content, as written
    for chunks in ([unannounced], list(unannounced)):
        stream_parser = HermesToolParser(TOOLS)
        text = "".join(stream_parser.feed(c)[0] for c in chunks)
        tail, deltas = stream_parser.finish(truncated=True)
        assert text + tail == "Sure." and deltas == []
    # a complete call whose closing tag was cut is a call either way
    whole = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_'
    assert [(c.name, c.arguments) for c in p.parse_as_streamed(whole, truncated=True)[1]] == [("get_time", "{}")]


def test_a_chat_choice_cut_by_max_tokens_reads_as_its_stream():
    from jaxserve.server.chat_output import ChoiceOutput

    cut = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"ci'
    whole = ChoiceOutput(None, HermesToolParser, TOOLS).message(cut, truncated=True)
    assert whole["content"] == "Let me check." and whole["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"ci'}
    streamed = ChoiceOutput(None, HermesToolParser, TOOLS)
    deltas = [streamed.feed(cut[:20]), streamed.feed(cut[20:]), streamed.finish(truncated=True)]
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    early = ChoiceOutput(None, HermesToolParser, TOOLS).message("Let me check. <tool_call>\n{", truncated=True)
    assert early["content"] == "Let me check." and "tool_calls" not in early


def test_parse_as_streamed_keeps_a_cut_call_a_call():
    # What the server answers for a forced tool choice: exactly what the stream sends.
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    content, calls = HermesToolParser(TOOLS).parse_as_streamed(cut)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Par')]
    whole = call("get_weather", '{"city": "Paris"}') + "\n" + call("get_time", "{}")
    content, calls = HermesToolParser(TOOLS).parse_as_streamed(whole)
    assert content is None and [(c.name, c.arguments) for c in calls] == parse(whole)[1]
    p = HermesToolParser(TOOLS)
    p.feed("<tool_call>")  # a parser mid-stream is left alone: a fresh one reads the text
    assert p.parse_as_streamed("hi") == ("hi", [])


def test_default_parse_of_the_base_class_assembles_the_stream():
    class Echo(ToolParser):
        name = "echo"

        def feed(self, text):
            return text, []

        def finish(self, truncated=False):
            return "", [ToolCallDelta(0, "call_x", "f", '{"a"'), ToolCallDelta(0, arguments=": 1}")]

    content, calls = Echo([]).parse("hi")
    assert content == "hi" and calls == [ToolCall("call_x", "f", '{"a": 1}')]


# ---------------------------------------------------------------- the tags in a vocabulary

QWEN_TAGS = {"<tool_call>": 151657, "</tool_call>": 151658}
EOS = [151645, 151643]


@dataclasses.dataclass
class Vocab:
    name: str      # a checkpoint of tool_checkpoints.py
    tok: Any       # its jaxserve Tokenizer
    llg: Any       # llguidance's view of it
    tags: ToolTags


@pytest.fixture(scope="module", params=["tiny", "plain-special", "plain-no-tags"])
def vocab(request, tmp_path_factory) -> Vocab:
    llguidance_hf = pytest.importorskip("llguidance.hf")
    from jaxserve.default_model import ensure_default_model
    from jaxserve.text.tokenizer import Tokenizer
    from tool_checkpoints import checkpoint

    tok = Tokenizer.from_pretrained(checkpoint(request.param, ensure_default_model(), tmp_path_factory.mktemp("ckpt")))
    tags = ToolTags.of(HermesToolParser.tags, tok)
    return Vocab(request.param, tok, llguidance_hf.from_tokenizer(tok.hf, n_vocab=151936, eos_token=EOS), tags)


def test_tool_tags_say_how_the_vocabulary_holds_the_tags(vocab):
    expected = {"tiny": (QWEN_TAGS, set()), "plain-special": (QWEN_TAGS, set(QWEN_TAGS.values())),
                "plain-no-tags": ({}, set())}[vocab.name]
    assert (vocab.tags.tokens, set(vocab.tags.special_ids)) == expected
    decoder = vocab.tags.decoder(vocab.tok)
    assert (decoder is vocab.tok) == (vocab.name != "plain-special")  # wrapped only where needed
    text = '<tool_call>\n{"name": "f"}\n</tool_call>'
    ids = vocab.tok.encode(text, add_special_tokens=False) + [151645]  # then <|im_end|>, special everywhere
    assert decoder.decode(ids) == text                                  # the tags survive, <|im_end|> does not
    assert decoder.decode(ids, skip_special_tokens=False) == vocab.tok.decode(ids, skip_special_tokens=False)
    if vocab.name == "plain-special":  # what the tokenizer alone does: the bug of issue 48
        assert vocab.tok.decode(ids) == '\n{"name": "f"}\n'


# ---------------------------------------------------------------- Hermes: forced-call grammar

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "hourly": {"type": "boolean"},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TREE_SCHEMA = {
    "type": "object",
    "$defs": {"leaf": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 99}},
                       "required": ["v"], "additionalProperties": False}},
    "properties": {"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/properties/left"}},
    "required": ["left", "right"],
    "additionalProperties": False,
}
FORCED_TOOLS = [
    {"type": "function", "function": {"name": "forecast", "parameters": ANSWER_SCHEMA}},
    {"type": "function", "function": {"name": "tree", "description": "see http://x.y // not a comment",
                                      "parameters": TREE_SCHEMA}},
    {"type": "function", "function": {"name": "ping"}},
]
NAMED = {"type": "function", "function": {"name": "tree"}}


def grammar(vocab: Vocab, choice, parallel: bool) -> str:
    return HermesToolParser.grammar(FORCED_TOOLS, choice, parallel, vocab.tags.tokens)


def matcher(vocab: Vocab, grammar: str):
    import llguidance

    m = llguidance.LLMatcher(vocab.llg, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(vocab: Vocab, grammar: str, text: str) -> bool:
    m = matcher(vocab, grammar)
    ok = m.consume_tokens(vocab.tok.encode(text, add_special_tokens=False))
    return ok and m.is_accepting()


def test_arguments_schema_rebases_local_references():
    schema = arguments_schema(FORCED_TOOLS[1]["function"], "#/anyOf/1/properties/arguments")
    assert schema["properties"]["left"] == {"$ref": "#/anyOf/1/properties/arguments/$defs/leaf"}
    assert schema["properties"]["right"] == {"$ref": "#/anyOf/1/properties/arguments/properties/left"}
    assert TREE_SCHEMA["properties"]["left"] == {"$ref": "#/$defs/leaf"}  # the tool is not modified
    assert arguments_schema({"name": "ping"}, "#") == {"type": "object", "properties": {},
                                                        "additionalProperties": False}
    assert arguments_schema({"name": "f", "parameters": {"properties": {}}}, "#")["type"] == "object"


def test_grammar_shape():
    g = HermesToolParser.grammar(FORCED_TOOLS, "required", True, QWEN_TAGS)
    lines = g.splitlines()
    # The tags are the added tokens, by id, where the vocabulary has them; else their text.
    assert lines[:3] == ['start: call ("\\n" call)*', 'call: <[151657]> "\\n" body "\\n" <[151658]>', lines[2]]
    assert HermesToolParser.grammar(FORCED_TOOLS, "required", True, {}).splitlines()[1] == \
        'call: "<tool_call>" "\\n" body "\\n" "</tool_call>"'
    body = json.loads(lines[2].removeprefix("body: %json "))
    assert body["x-guidance"] == {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    assert [a["properties"]["name"] for a in body["anyOf"]] == [{"const": "forecast"}, {"const": "tree"},
                                                                {"const": "ping"}]
    one = HermesToolParser.grammar(FORCED_TOOLS, NAMED, False, QWEN_TAGS)
    assert one.splitlines()[0] == "start: call"
    assert [a["properties"]["name"] for a in json.loads(one.splitlines()[2][12:])["anyOf"]] == [{"const": "tree"}]
    for choice in ("auto", "none", {"type": "function", "function": {"name": "nope"}}):
        with pytest.raises(ValueError):
            HermesToolParser.grammar(FORCED_TOOLS, choice, True, QWEN_TAGS)
    with pytest.raises(ValueError, match="needs at least one tool"):
        HermesToolParser.grammar([], "required", True, QWEN_TAGS)


def test_grammar_accepts_calls_and_rejects_everything_else(vocab):
    required = grammar(vocab, "required", False)
    parallel = grammar(vocab, "required", True)
    named = grammar(vocab, NAMED, True)
    fc = call("forecast", '{"city": "Paris", "unit": "C"}')
    tree = call("tree", '{"left": {"v": 1}, "right": {"v": 22}}')
    ping = call("ping", "{}")
    for text in (fc, tree, ping):
        assert accepts(vocab, required, text) and accepts(vocab, parallel, text)
    assert accepts(vocab, parallel, fc + "\n" + tree + "\n" + ping)
    assert not accepts(vocab, required, fc + "\n" + ping)                   # one call only
    assert accepts(vocab, named, tree) and accepts(vocab, named, tree + "\n" + tree)
    assert not accepts(vocab, named, fc)                                     # only the named function
    for bad in ("Sure! " + fc,                                               # no content
                fc.replace('"unit": "C"', '"unit": "K"'),                    # schema enforced
                fc.replace('"C"}', '"C", "x": 1}'),                          # no extra keys
                fc.replace(", ", ","),                                       # compact separators only
                fc.replace("\n{", "\n {"),
                '<tool_call>\n{"name": "ping"}\n</tool_call>',               # arguments required
                call("other", "{}")):
        assert not accepts(vocab, parallel, bad), bad
    # The tags are the added tokens where there are some, as a model trained on the format writes
    # them; else text.
    starts_with_text = matcher(vocab, required).consume_tokens(vocab.tok.encode("<", add_special_tokens=False))
    if vocab.tags.tokens:
        assert matcher(vocab, required).consume_tokens([151657]) and not starts_with_text
    else:
        assert starts_with_text


def assert_compact(json_text: str) -> None:
    """JSON written like json.dumps / the template's tojson: ", " and ": " and no other whitespace."""
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', json_text)
    assert not re.search(r"\s", outside_strings.replace(", ", ",").replace(": ", ":")), json_text


def random_walk(vocab: Vocab, grammar: str, seed: int, max_tokens: int = 400) -> tuple[str, list[int]]:
    """Sample uniformly among the tokens the grammar allows until it stops; decode as the server
    decodes a request whose output a tool parser reads."""
    m = matcher(vocab, grammar)
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    while not m.is_stopped():
        assert len(ids) < max_tokens, vocab.tok.decode(ids, skip_special_tokens=False)
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[:151936])
        assert allowed.size, m.get_error()
        token = int(rng.choice(allowed))
        assert m.consume_token(token), m.get_error()
        ids.append(token)
    return vocab.tags.decoder(vocab.tok).decode(ids, skip_special_tokens=True), ids


@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False), (NAMED, True)])
def test_random_walks_through_the_grammar_parse_to_valid_calls(vocab, choice, parallel):
    jsonschema = pytest.importorskip("jsonschema")
    g = grammar(vocab, choice, parallel)
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0})
               for t in FORCED_TOOLS}
    seen: set[str] = set()
    counts = set()
    for seed in range(12):
        text, _ = random_walk(vocab, g, seed)
        content, calls = HermesToolParser(FORCED_TOOLS).parse(text)
        assert content is None and calls, text
        assert parallel or len(calls) == 1
        counts.add(len(calls))
        blocks = [f'<tool_call>\n{{"name": "{c.name}", "arguments": {c.arguments}}}\n</tool_call>' for c in calls]
        assert text == "\n".join(blocks)
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])
            assert_compact(c.arguments)
            seen.add(c.name)
    if isinstance(choice, dict):
        assert seen == {"tree"}
    else:
        assert len(seen) >= 2
    if parallel:
        assert max(counts) > 1


def test_random_walk_text_streams_token_by_token_like_parse(vocab):
    g = grammar(vocab, "required", True)
    decoder = vocab.tags.decoder(vocab.tok)
    for seed in range(4):
        text, ids = random_walk(vocab, g, 100 + seed)
        pieces, prev = [], ""
        for n in range(1, len(ids) + 1):  # incremental detokenization, as the server streams
            now = decoder.decode(ids[:n], skip_special_tokens=True)
            if now.endswith("\ufffd") and n < len(ids):
                continue  # an incomplete UTF-8 character: wait for the rest
            pieces.append(now[len(prev):])
            prev = now
        assert "".join(pieces) == text
        content, deltas = stream(pieces)
        _, calls = HermesToolParser(FORCED_TOOLS).parse(text)
        assert content == "" and assembled(deltas) == [(c.name, c.arguments) for c in calls]
