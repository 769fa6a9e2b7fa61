"""Reasoning parsers: whole-text splits, and streamed splits over every way to chunk the text.

Uses the real Qwen tokenizer of the embedded default model, where `<think>` and `</think>` are
single added (not special) tokens, so the tags reach the parser as text exactly as served.
"""

from __future__ import annotations

import itertools

import pytest

from jaxserve.default_model import ensure_default_model
from jaxserve.text.detokenizer import IncrementalDetokenizer
from jaxserve.server.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningDelta,
    ReasoningParser,
    get_reasoning_parser,
)
from jaxserve.text.tokenizer import Tokenizer

THINK, END_THINK = 151667, 151668
ASSISTANT_PROMPT = "<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n"
NO_THINKING_PROMPT = ASSISTANT_PROMPT + "<think>\n\n</think>\n\n"   # Qwen3, enable_thinking=false
OPEN_THINK_PROMPT = ASSISTANT_PROMPT + "<think>\n"                  # R1 / Qwen3-thinking templates

SHORT = ("<think>a</think>b", "a", "b")
LONG = ("<think>\nLet me think about it.\n</think>\n\nThe answer is 42.",
        "\nLet me think about it.\n", "The answer is 42.")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(ensure_default_model())


# ------------------------------------------------------------ helpers


def cuts(text: str, pieces: int):
    """Every way to cut text into `pieces` non-empty consecutive chunks."""
    for points in itertools.combinations(range(1, len(text)), pieces - 1):
        bounds = (0, *points, len(text))
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def stream(parser: ReasoningParser, chunks) -> list[ReasoningDelta]:
    deltas = [parser.feed(c) for c in chunks]
    deltas.append(parser.finish())
    return deltas


def check_stream(cls: type[ReasoningParser], prompt: str, chunks, reasoning: str | None,
                 content: str | None) -> None:
    """Streaming the chunks gives exactly (reasoning, content), equal to parse(), with no tag pieces."""
    parser = cls(prompt)
    deltas = stream(parser, chunks)
    for d in deltas:
        for side in (d.reasoning, d.content):
            # The only angle brackets in these texts are the tags': any piece of a tag shows one.
            assert "<" not in side and ">" not in side, (chunks, deltas)
    got = ("".join(d.reasoning for d in deltas) or None, "".join(d.content for d in deltas) or None)
    assert got == (reasoning, content), chunks
    assert cls(prompt).parse("".join(chunks)) == got


def token_chunks(tok: Tokenizer, text: str, prompt: str) -> list[str]:
    """The text as served: one detokenized delta per generated token (flush appended)."""
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt, add_special_tokens=False))
    chunks = [detok.push([t]).delta for t in ids]
    chunks.append(detok.flush())
    assert "".join(chunks) == text
    return chunks


# ------------------------------------------------------------ the tokenizer sees the tags as tokens


def test_think_tags_are_single_unskipped_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(SHORT[0], add_special_tokens=False)
    assert ids[0] == THINK and END_THINK in ids
    assert tok.decode(ids, skip_special_tokens=True) == SHORT[0]
    long_ids = tok.encode(LONG[0], add_special_tokens=False)
    assert long_ids.count(THINK) == 1 and long_ids.count(END_THINK) == 1
    assert len(long_ids) > 8  # multi-token reasoning and answer


# ------------------------------------------------------------ every chunking


@pytest.mark.parametrize("cls", [Qwen3ReasoningParser, DeepSeekR1ReasoningParser])
@pytest.mark.parametrize("case", [SHORT, LONG], ids=["short", "long"])
def test_every_chunking_splits_exactly(tok: Tokenizer, cls: type[ReasoningParser], case) -> None:
    text, reasoning, content = case
    assert cls(ASSISTANT_PROMPT).parse(text) == (reasoning, content)
    check_stream(cls, ASSISTANT_PROMPT, [text], reasoning, content)
    check_stream(cls, ASSISTANT_PROMPT, list(text), reasoning, content)  # one character a chunk
    for pieces in (2, 3):
        for chunks in cuts(text, pieces):
            check_stream(cls, ASSISTANT_PROMPT, chunks, reasoning, content)
    check_stream(cls, ASSISTANT_PROMPT, token_chunks(tok, text, ASSISTANT_PROMPT), reasoning, content)


@pytest.mark.parametrize("cls", [Qwen3ReasoningParser, DeepSeekR1ReasoningParser])
def test_every_token_chunking(tok: Tokenizer, cls: type[ReasoningParser]) -> None:
    """Every way to group the short text's tokens into detokenizer pushes."""
    text, reasoning, content = SHORT
    ids = tok.encode(text, add_special_tokens=False)
    for mask in range(2 ** (len(ids) - 1)):
        bounds = [0] + [i + 1 for i in range(len(ids) - 1) if mask >> i & 1] + [len(ids)]
        detok = IncrementalDetokenizer(tok, [])
        chunks = [detok.push(ids[a:b]).delta for a, b in zip(bounds, bounds[1:])] + [detok.flush()]
        check_stream(cls, ASSISTANT_PROMPT, chunks, reasoning, content)


# ------------------------------------------------------------ qwen3


def test_qwen3_thinking_disabled_is_all_content(tok: Tokenizer) -> None:
    out = "The answer is 42."
    parser = Qwen3ReasoningParser(NO_THINKING_PROMPT)
    assert parser.reasoning_ended and not parser.in_reasoning
    assert parser.parse(out) == (None, out)
    for chunks in cuts(out, 2):
        check_stream(Qwen3ReasoningParser, NO_THINKING_PROMPT, chunks, None, out)
    check_stream(Qwen3ReasoningParser, NO_THINKING_PROMPT, token_chunks(tok, out, NO_THINKING_PROMPT),
                 None, out)
    # A tag after the reasoning is over is answer text.
    assert parser.parse("x <think>y</think>") == (None, "x <think>y</think>")


def test_qwen3_without_tags_is_all_content(tok: Tokenizer) -> None:
    for out in ("The answer is 42.", "\n\nHello", "<b>bold</b>", "<thinking>", "a</think>b"):
        assert Qwen3ReasoningParser(ASSISTANT_PROMPT).parse(out) == (None, out)
        for chunks in cuts(out, 2):
            parser = Qwen3ReasoningParser(ASSISTANT_PROMPT)
            deltas = stream(parser, chunks)
            assert "".join(d.content for d in deltas) == out
            assert all(d.reasoning == "" for d in deltas)
    # Held "<thi" that never becomes a tag is content at the end.
    parser = Qwen3ReasoningParser(ASSISTANT_PROMPT)
    assert parser.feed("<thi") == ReasoningDelta()
    assert parser.finish() == ReasoningDelta(content="<thi")


def test_qwen3_states_and_unclosed_block() -> None:
    parser = Qwen3ReasoningParser(ASSISTANT_PROMPT)
    assert not parser.in_reasoning and not parser.reasoning_ended
    assert parser.feed(" <thi") == ReasoningDelta()         # may still open a block
    assert parser.feed("nk>\nhmm</th") == ReasoningDelta(reasoning="\nhmm")
    assert parser.in_reasoning and not parser.reasoning_ended
    assert parser.feed("ink>") == ReasoningDelta()
    assert parser.reasoning_ended and not parser.in_reasoning
    assert parser.feed("\n\n") == ReasoningDelta()          # newlines after </think> are dropped
    assert parser.feed("\nok\n") == ReasoningDelta(content="ok\n")
    assert parser.finish() == ReasoningDelta()
    with pytest.raises(ValueError):
        parser.feed("more")
    # Opened but never closed: everything after <think> is reasoning, including a held "</thi".
    assert Qwen3ReasoningParser().parse("<think>still thinking</thi") == ("still thinking</thi", None)
    assert Qwen3ReasoningParser().parse("<think>\n\n</think>\n\n") == ("\n\n", None)
    assert Qwen3ReasoningParser().parse("<think></think>answer") == (None, "answer")


def test_qwen3_prompt_opened_the_block() -> None:
    parser = Qwen3ReasoningParser(OPEN_THINK_PROMPT)
    assert parser.in_reasoning
    assert parser.parse("a</think>b") == ("a", "b")
    for chunks in cuts("a</think>\n\nb", 3):
        check_stream(Qwen3ReasoningParser, OPEN_THINK_PROMPT, chunks, "a", "b")


# ------------------------------------------------------------ deepseek_r1


def test_deepseek_r1_prompt_opened_the_block(tok: Tokenizer) -> None:
    out = "a</think>b"
    parser = DeepSeekR1ReasoningParser(OPEN_THINK_PROMPT)
    assert parser.in_reasoning and not parser.reasoning_ended
    assert parser.parse(out) == ("a", "b")
    for pieces in (2, 3):
        for chunks in cuts(out, pieces):
            check_stream(DeepSeekR1ReasoningParser, OPEN_THINK_PROMPT, chunks, "a", "b")
    check_stream(DeepSeekR1ReasoningParser, OPEN_THINK_PROMPT, token_chunks(tok, out, OPEN_THINK_PROMPT),
                 "a", "b")
    # Reasoning even when the prompt does not show the open block; a leading <think> is dropped.
    assert DeepSeekR1ReasoningParser().parse(out) == ("a", "b")
    assert DeepSeekR1ReasoningParser().parse("<think>a</think>b") == ("a", "b")
    assert DeepSeekR1ReasoningParser().parse("a</think>\n\nb <think>c</think>") == ("a", "b <think>c</think>")


def test_deepseek_r1_without_end_tag_is_all_reasoning(tok: Tokenizer) -> None:
    out = "Let me think about it. Still thinking"
    assert DeepSeekR1ReasoningParser(OPEN_THINK_PROMPT).parse(out) == (out, None)
    for chunks in cuts(out, 2):
        check_stream(DeepSeekR1ReasoningParser, OPEN_THINK_PROMPT, chunks, out, None)
    check_stream(DeepSeekR1ReasoningParser, OPEN_THINK_PROMPT, token_chunks(tok, out, OPEN_THINK_PROMPT),
                 out, None)
    assert DeepSeekR1ReasoningParser().parse("x</thi") == ("x</thi", None)  # held, then flushed


# ------------------------------------------------------------ shared pieces


def test_parse_leaves_the_stream_alone() -> None:
    parser = Qwen3ReasoningParser()
    assert parser.feed("<think>a</th") == ReasoningDelta(reasoning="a")
    assert parser.parse("no tags") == (None, "no tags")
    assert parser.feed("ink>b") == ReasoningDelta(content="b")
    assert parser.parse("") == (None, None)


def test_starts_in_reasoning() -> None:
    assert ReasoningParser.starts_in_reasoning(OPEN_THINK_PROMPT)
    assert not ReasoningParser.starts_in_reasoning(NO_THINKING_PROMPT)
    assert not ReasoningParser.starts_in_reasoning(ASSISTANT_PROMPT)
    assert not ReasoningParser.starts_in_reasoning("")
    assert Qwen3ReasoningParser.starts_in_reasoning("<think>a</think>b<think>\n")
    assert not DeepSeekR1ReasoningParser.starts_in_reasoning("<think>\n</think>")


def test_registry() -> None:
    assert REASONING_PARSERS == {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser}
    for name, cls in REASONING_PARSERS.items():
        assert get_reasoning_parser(name) is cls and cls.name == name
    with pytest.raises(ValueError, match="'nope'.*deepseek_r1, qwen3"):
        get_reasoning_parser("nope")
