"""A sequence's grammar state over the real Qwen vocabulary: masks agree with what the guide
accepts (added tokens included), a grammar that nothing can extend finishes the sequence, and a reasoning prefix lets
the model think before the constrained answer."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.runner.sampler import bitmask_words
from jaxserve.server.reasoning import get_reasoning_parser
from jaxserve.structured import StructuredOutputs
from jaxserve.structured.guide import fill_bitmask
from jaxserve.structured.reasoning import reasoning_prefix

CALL = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def compiler(llm):
    return llm.grammars


@pytest.fixture(scope="module")
def hf(llm):
    return llm.tokenizer.hf


def _allowed(guide, vocab_size: int) -> set[int]:
    mask = fill_bitmask([guide], 1, bitmask_words(vocab_size))
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[0, :vocab_size]
    return set(np.flatnonzero(bits).tolist())


def _walk(guide, hf, vocab_size: int, token_ids: list[int]) -> None:
    """Feeds the tokens, asserting the mask allowed each one before it."""
    for t in token_ids:
        assert t in _allowed(guide, vocab_size), hf.convert_ids_to_tokens(t)
        assert guide.accept(t)


def test_text_spelled_by_an_added_token_is_accepted_as_that_token(compiler, hf):
    """A choice whose text starts with "<tool_call>" (one added token in Qwen's vocabulary): the mask
    offers that token, and accepting it advances the grammar past its text."""
    guide = compiler.compile(StructuredOutputs(choice=[CALL])).new_guide()
    ids = hf.encode(CALL)
    assert ids[0] == hf.convert_tokens_to_ids("<tool_call>")
    _walk(guide, hf, compiler.vocab_size, ids[:-1])
    assert not guide.finished
    _walk(guide, hf, compiler.vocab_size, ids[-1:])  # "</tool_call>", also an added token
    assert guide.finished and not guide.failed  # nothing can follow: the sequence stops here


def test_a_token_outside_the_mask_fails_the_guide(compiler, hf):
    guide = compiler.compile(StructuredOutputs(regex="[0-9]+")).new_guide()
    letter = hf.encode("a")[0]
    assert letter not in _allowed(guide, compiler.vocab_size)
    assert not guide.accept(letter)
    assert guide.failed and guide.finished


def test_padding_ids_past_the_tokenizer_are_never_allowed(compiler, hf):
    guide = compiler.compile(StructuredOutputs(regex="(.|\n)*")).new_guide()
    allowed = _allowed(guide, compiler.vocab_size)
    assert len(hf) < compiler.vocab_size and not any(t >= len(hf) for t in allowed)


@pytest.mark.parametrize("think", [True, False])
def test_the_answer_is_constrained_only_after_the_reasoning(compiler, hf, think):
    family = get_reasoning_parser("qwen3")
    prefix = reasoning_prefix(family, "<|im_start|>assistant\n")
    guide = compiler.compile(StructuredOutputs(choice=["yes", "no"]), prefix).new_guide()
    text = "<think>\nmaybe {not json} yes\n</think>\n\nno" if think else "yes"
    _walk(guide, hf, compiler.vocab_size, hf.encode(text))
    assert guide.finished and not guide.failed
    # After the reasoning the constraint holds again.
    late = compiler.compile(StructuredOutputs(choice=["yes", "no"]), prefix).new_guide()
    _walk(late, hf, compiler.vocab_size, hf.encode("<think>x</think>\n\n"))
    assert hf.encode("maybe")[0] not in _allowed(late, compiler.vocab_size)


def test_a_closed_block_in_the_prompt_means_no_reasoning_part(compiler, hf):
    family = get_reasoning_parser("qwen3")
    prefix = reasoning_prefix(family, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prefix == ""
    guide = compiler.compile(StructuredOutputs(choice=["yes"]), prefix).new_guide()
    assert hf.convert_tokens_to_ids("<think>") not in _allowed(guide, compiler.vocab_size)


def test_structural_tag_constrains_only_the_tagged_segment(compiler, hf):
    """vLLM's structural tag: free text, and after a trigger the segment's schema up to its end."""
    tag = {"structures": [{"begin": "<fn=add>", "end": "</fn>",
                           "schema": {"type": "object", "required": ["a"], "additionalProperties": False,
                                      "properties": {"a": {"type": "integer"}}}}],
           "triggers": ["<fn="]}
    spec = StructuredOutputs(structural_tag=tag)
    guide = compiler.compile(spec).new_guide()
    _walk(guide, hf, compiler.vocab_size, hf.encode('Sure. <fn=add>{"a": 12}</fn> Done, anything else?'))
    assert not guide.failed
    inside = compiler.compile(spec).new_guide()
    _walk(inside, hf, compiler.vocab_size, hf.encode("x <fn=add"))
    allowed = _allowed(inside, compiler.vocab_size)  # the tag's end and the object's start are forced
    assert allowed and all(hf.decode([t]).startswith(">{") for t in allowed), [hf.decode([t]) for t in allowed]
