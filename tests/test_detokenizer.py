"""Incremental detokenizer: UTF-8 safety, spacing, stop strings — over every way to chunk a stream."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.default_model import ensure_default_model
from jaxserve.text.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer
from jaxserve.text.tokenizer import Tokenizer

PROMPT = [151644, 77091, 198]  # "<|im_start|>assistant\n"
NL = 198                        # "\n" as one token ("\n\n" is normally its own token, 271)


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "jaxserve_cache"


@pytest.fixture(scope="module")
def tok(cache_root):
    return Tokenizer.from_pretrained(ensure_default_model(cache_root))


def chunkings(ids, rng=None, samples=0):
    """Every split of ids into consecutive non-empty chunks (2^(n-1) of them), or `samples` random ones."""
    n = len(ids)
    if rng is None:
        masks = range(2 ** (n - 1))
    else:
        masks = (rng.getrandbits(n - 1) for _ in range(samples))
    for mask in masks:
        cuts = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        yield [ids[a:b] for a, b in zip(cuts, cuts[1:])]


def stream(tok, chunks, **kw):
    """Push chunks; return (deltas, results, flushed text)."""
    d = IncrementalDetokenizer(tok, PROMPT, **kw)
    results = [d.push(c) for c in chunks]
    return [r.delta for r in results], results, d.flush()


def byte_token_ids(tok, text):
    """One token per UTF-8 byte: forces every multi-byte character to span several tokens."""
    from jaxserve.default_model import _byte_to_unicode

    b2u = _byte_to_unicode()
    return [tok.hf.convert_tokens_to_ids(b2u[b]) for b in text.encode("utf-8")]


SHORT_TEXTS = {
    "chinese_rare": "龘靐齉爩鱻",                    # 9 tokens, characters split across tokens
    "cjk_ext_b": "𠀋𪚥 饕餮",                        # 4-byte characters
    "emoji_zwj_flags": "🧑🏽‍💻🏳️‍🌈🇺🇳",            # ZWJ sequences, skin tone, flags
    "code_mixed": "d={'键':1} # 平方✓\n",
}


@pytest.mark.parametrize("name", sorted(SHORT_TEXTS))
def test_every_chunking_of_short_streams_matches_full_decode(tok, name):
    ids = tok.encode(SHORT_TEXTS[name], add_special_tokens=False)
    assert len(ids) <= 14
    # The case is only hard if some token alone decodes to U+FFFD.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    expected = tok.decode(ids)
    count = 0
    for chunks in chunkings(ids):
        deltas, results, rest = stream(tok, chunks)
        assert all("\ufffd" not in d for d in deltas), chunks
        assert "".join(deltas) + rest == expected
        assert rest == ""  # nothing incomplete is left at the end of complete text
        assert not any(r.stopped for r in results)
        count += 1
    assert count == 2 ** (len(ids) - 1)


def test_every_chunking_of_single_byte_tokens(tok):
    text = "a中🙂é"
    ids = byte_token_ids(tok, text)
    assert len(ids) == 1 + 3 + 4 + 2 and tok.decode(ids) == text
    for chunks in chunkings(ids):
        deltas, _, rest = stream(tok, chunks)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) + rest == text


def test_random_chunkings_of_long_mixed_stream(tok):
    text = "".join(SHORT_TEXTS.values()) + " 👨‍👩‍👧‍👦 and 🇯🇵! def f():\n\treturn '平方' # ok\n\n" * 3
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 60
    rng = random.Random(1234)
    for chunks in chunkings(ids, rng=rng, samples=150):
        deltas, _, rest = stream(tok, chunks)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) + rest == text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=40), seed=st.integers(0, 2**32 - 1))
def test_any_text_any_chunking(tok, text, seed):
    ids = tok.encode(text, add_special_tokens=False)
    expected = tok.decode(ids)
    ids_bytes = byte_token_ids(tok, text)
    for seq, want in [(ids, expected), (ids_bytes, text)]:
        if len(seq) < 2:
            continue
        for chunks in chunkings(seq, rng=random.Random(seed), samples=3):
            deltas, _, rest = stream(tok, chunks)
            assert "".join(deltas) + rest == want
            # A delta may hold U+FFFD only where the text itself has one.
            assert "\ufffd" not in "".join(deltas) or "\ufffd" in want


def test_incomplete_trailing_bytes_are_held_then_flushed_like_full_decode(tok):
    ids = byte_token_ids(tok, "ok中")[:-1]  # "ok" + 2 of the 3 bytes of 中
    d = IncrementalDetokenizer(tok, PROMPT)
    assert d.push(ids).delta == "ok"
    assert d.flush() == "\ufffd" == tok.decode(ids)[2:]


def test_invalid_bytes_followed_by_text_come_out_as_full_decode(tok):
    ids = byte_token_ids(tok, "\u00e9")[1:] + tok.encode(" fine", add_special_tokens=False)  # a lone continuation byte
    expected = tok.decode(ids)
    assert expected == "\ufffd fine"
    for chunks in chunkings(ids):
        deltas, _, rest = stream(tok, chunks)
        assert "".join(deltas) + rest == expected


def test_window_stays_small_on_long_streams(tok):
    # Per-push cost must not grow with the output: record the length of every decode call.
    class Recording:
        def __init__(self, inner):
            self.inner, self.lengths = inner, []

        def decode(self, ids, skip_special_tokens=True):
            self.lengths.append(len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode("龘靐 👨‍👩‍👧‍👦 hello world, 你好。\n" * 60, add_special_tokens=False)
    rec = Recording(tok)
    d = IncrementalDetokenizer(rec, PROMPT)
    out = "".join(d.push([i]).delta for i in ids) + d.flush()
    assert out == tok.decode(ids)
    assert len(ids) > 500
    assert max(rec.lengths) <= 8


def test_undecodable_garbage_does_not_grow_the_window_forever(tok):
    lone = byte_token_ids(tok, "\u00e9")[1]  # continuation byte: always U+FFFD
    ids = [lone] * (3 * MAX_PENDING_TOKENS)
    d = IncrementalDetokenizer(tok, PROMPT)
    out = "".join(d.push([i]).delta for i in ids)
    assert 0 < len(out)  # given up on and emitted, not held forever
    assert out + d.flush() == tok.decode(ids)


# ---------------------------------------------------------------- stop strings


def run_stop(tok, chunks, stop, include=False, prompt=PROMPT):
    d = IncrementalDetokenizer(tok, prompt, stop=stop, include_stop_str_in_output=include)
    deltas, results = [], []
    for c in chunks:
        r = d.push(c)
        deltas.append(r.delta)
        results.append(r)
    return deltas, results, d.flush(), d


@pytest.mark.parametrize(
    "text, stop, expected",
    [
        ("STOP right there", "STOP", ""),                         # at the very start
        ("The answer is 42. END OF STORY and more", " END OF", "The answer is 42."),  # " END"," OF": 2 tokens
        ("x <<<END>>> y", "<END>", "x <<"),                      # inside '<<<','END','>>>': 3 tokens
        ("龘靐齉爩鱻", "齉爩", "龘靐"),                              # across byte-split tokens
        ("The end\n\nNext part", "\n\n", "The end"),
    ],
)
def test_stop_string_cut_for_every_chunking(tok, text, stop, expected):
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) > 12:
        chunk_sets = list(chunkings(ids, rng=random.Random(7), samples=300))
    else:
        chunk_sets = list(chunkings(ids))
    for chunks in chunk_sets:
        deltas, results, rest, d = run_stop(tok, chunks, [stop, "NEVER-SEEN"])
        out = "".join(deltas) + rest
        assert out == expected, chunks
        assert not any(stop in x for x in deltas)
        assert d.stopped and d.stop_str == stop
        first = next(i for i, r in enumerate(results) if r.stopped)
        assert all(r.stopped and r.delta == "" and r.stop_str == stop for r in results[first + 1:])
        # Held-back text never leaks: everything sent is a prefix of the answer.
        sent = ""
        for x in deltas:
            sent += x
            assert expected.startswith(sent)


def test_stop_on_double_newline_split_across_pushes(tok):
    ids = tok.encode("line one", add_special_tokens=False) + [NL] + [NL] + tok.encode("line two", add_special_tokens=False)
    assert tok.decode(ids) == "line one\n\nline two"
    deltas, results, rest, d = run_stop(tok, [[i] for i in ids], ["\n\n"])
    assert "".join(deltas) + rest == "line one"
    nl1 = len(tok.encode("line one", add_special_tokens=False))
    assert results[nl1].delta == "" and not results[nl1].stopped  # the first "\n" is held back
    assert results[nl1 + 1].stopped and results[nl1 + 1].stop_str == "\n\n"


def test_include_stop_str_in_output(tok):
    ids = tok.encode("The answer is 42. END OF STORY and more", add_special_tokens=False)
    for chunks in chunkings(ids, rng=random.Random(3), samples=50):
        deltas, _, rest, _ = run_stop(tok, chunks, [" END OF"], include=True)
        assert "".join(deltas) + rest == "The answer is 42. END OF"


def test_held_prefix_is_released_when_it_is_not_a_stop(tok):
    st_ids = tok.encode("ST", add_special_tokens=False)
    art_ids = tok.encode("ART", add_special_tokens=False)
    assert tok.decode(st_ids + art_ids) == "START"
    d = IncrementalDetokenizer(tok, PROMPT, stop=["STOP"])
    assert d.push(st_ids).delta == ""           # could be the start of "STOP"
    assert d.push(art_ids).delta == "START"     # it was not
    d2 = IncrementalDetokenizer(tok, PROMPT, stop=["STOP"])
    assert d2.push(tok.encode("go ST", add_special_tokens=False)).delta == "go "
    assert d2.flush() == "ST"                   # at finish, held text is released
    assert not d2.stopped


def test_earliest_stop_wins_and_pushes_after_stop_are_ignored(tok):
    d = IncrementalDetokenizer(tok, PROMPT, stop=["gamma", "beta"])
    r = d.push(tok.encode("alpha beta gamma", add_special_tokens=False))
    assert (r.delta, r.stopped, r.stop_str) == ("alpha ", True, "beta")
    # Tokens sampled after the stop (already in flight) produce nothing.
    r2 = d.push(tok.encode(" more", add_special_tokens=False))
    assert (r2.delta, r2.stopped, r2.stop_str) == ("", True, "beta")
    assert d.flush() == ""


def test_stop_found_in_flushed_text(tok):
    ids = byte_token_ids(tok, "ab中")[:-1]  # ends in an incomplete char: U+FFFD appears only at flush
    d = IncrementalDetokenizer(tok, PROMPT, stop=["\ufffd"])
    assert d.push(ids).delta == "ab"
    assert d.flush() == "" and d.stopped and d.stop_str == "\ufffd"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_every_chunking(tok, skip):
    ids = tok.encode("Hi<think>ok</think><|im_end|>\n<|endoftext|>", add_special_tokens=False)
    assert 151645 in ids and len(ids) <= 12
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in expected) is (not skip)
    for chunks in chunkings(ids):
        deltas, _, rest = stream(tok, chunks, skip_special_tokens=skip)
        assert "".join(deltas) + rest == expected


def test_stop_string_on_special_token_text_only_without_skipping(tok):
    ids = tok.encode("done<|im_end|>tail", add_special_tokens=False)
    kept, _, rest, d = run_stop(tok, [[i] for i in ids], ["<|im_end|>"])
    assert "".join(kept) + rest == "donetail" and not d.stopped
    d2 = IncrementalDetokenizer(tok, PROMPT, skip_special_tokens=False, stop=["<|im_end|>"])
    out = "".join(d2.push([i]).delta for i in ids) + d2.flush()
    assert out == "done" and d2.stopped


def test_bad_arguments_raise_value_error(tok):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, PROMPT, stop=[""])
    with pytest.raises(ValueError, match="list of strings"):
        IncrementalDetokenizer(tok, PROMPT, stop="STOP")
    d = IncrementalDetokenizer(tok, PROMPT)
    with pytest.raises(ValueError, match="non-negative ints"):
        d.push([-1])
    d.flush()
    with pytest.raises(ValueError, match="after flush"):
        d.push([1])


# ---------------------------------------------------------------- SentencePiece spacing


def test_sentencepiece_leading_spaces_follow_the_prompt():
    # A small Metaspace ("▁word") BPE trained in memory: its decoder drops the leading space of the
    # first token it sees, so one-token-at-a-time decoding would glue words together.
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = HFTok(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    corpus = ["hello world how are you today", "the quick brown fox", "hello there world"] * 20
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    sp = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")

    prompt = sp.encode("hello world")
    out = sp.encode(" how are you today the quick brown fox")
    full = sp.decode(prompt + out)
    want = full[len(sp.decode(prompt)):]
    assert want == " how are you today the quick brown fox"
    assert sp.decode(out[:1]) == "how"  # naive decode loses the space
    for chunks in chunkings(out, rng=random.Random(5), samples=64):
        d = IncrementalDetokenizer(sp, prompt)
        got = "".join(d.push(c).delta for c in chunks) + d.flush()
        assert got == want, chunks
