"""Prompt-lookup proposals and the --speculative-config description (host code, no jax)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.speculative.config import SpeculativeConfig
from jaxserve.speculative.ngram import TokenHistory


def propose(tokens: list[int], k: int, min_n: int, max_n: int) -> np.ndarray:
    """TokenHistory.propose over a whole token list."""
    history = TokenHistory()
    history.extend(tokens)
    return history.propose(k, min_n, max_n)


def test_the_longest_recurring_suffix_proposes_what_followed_its_latest_occurrence():
    seq = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 2, 3, 4]
    # suffix [2, 3, 4] occurred at 1 and at 6: the latest (6) was followed by 7, 2, 3
    assert propose(seq, k=3, min_n=1, max_n=3).tolist() == [7, 2, 3]
    # 5 tokens do not follow the latest occurrence: the earliest one's are taken
    assert propose(seq, k=5, min_n=1, max_n=3).tolist() == [5, 9, 2, 3, 4]
    assert propose([3, 1, 2, 3], k=5, min_n=1, max_n=1).tolist() == [1, 2, 3]    # fewer near the end
    # only shorter n-grams recur: [4] alone matched at 8 -> [2, 3]
    assert propose([8, 4, 2, 3, 6, 6, 4], k=2, min_n=1, max_n=3).tolist() == [2, 3]
    assert propose([8, 4, 2, 3, 6, 6, 4], k=2, min_n=2, max_n=3).tolist() == []  # below min_n: nothing
    # a repeating run: the latest occurrence of [5, 5] is followed by one token, the earliest by two
    assert propose([5, 5, 5, 5], k=4, min_n=1, max_n=2).tolist() == [5, 5]
    assert propose([5, 5, 5, 5, 5, 5, 5], k=3, min_n=1, max_n=2).tolist() == [5, 5, 5]
    assert propose([1], k=4, min_n=1, max_n=3).tolist() == [] and propose([], k=2, min_n=1, max_n=2).size == 0


def test_speculative_config_parses_vllms_shape_and_names_bad_fields():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                                  '"prompt_lookup_max": 5, "disable_by_batch_size": 16}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 2, 5)
    assert cfg.active(16) and not cfg.active(17)
    assert SpeculativeConfig.parse({"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}).model == "/m"
    for text, message in [
        ("{", "not JSON"),
        ('{"method": "medusa", "num_speculative_tokens": 2}', "method 'medusa' is not one of ngram, draft_model, eagle3"),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "at most 16"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "model not allowed for method 'ngram'"),
        ('{"method": "eagle3", "num_speculative_tokens": 2}', "needs a model directory"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
         "prompt_lookup_min 4 exceeds prompt_lookup_max 2"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(text)


def _reference_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The lookup as a sliding-window comparison over every earlier window (the oracle)."""
    seq = np.asarray(tokens, np.int64)
    length = len(seq)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:length - 1], n)  # windows before the suffix
        hits = np.flatnonzero((windows == seq[length - n:]).all(axis=1))
        if len(hits):
            starts = hits + n
            full = starts[starts + k <= length]
            start = full[-1] if len(full) else starts[0]
            return seq[start:start + k].tolist()
    return []


def test_a_token_history_extended_step_by_step_proposes_what_a_window_search_finds():
    """The engine keeps each sequence's tokens as bytes (appended per step, never rebuilt) and
    searches them with bytes.rfind / find: proposals equal the sliding-window oracle's, including
    ids whose bytes also match across token boundaries (256 = 00 01 00 00, 65536, 2**24 + 1)."""
    import random

    rng = random.Random(0)
    alphabets = [[0, 1, 2, 3], [0, 1, 256, 65536, 2**24 + 1, 257, 151935]]
    for trial in range(300):
        alphabet = alphabets[trial % 2]
        k, min_n = rng.randint(1, 6), rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        history, tokens = TokenHistory(), []
        for _ in range(rng.randint(1, 30)):
            new = [rng.choice(alphabet) for _ in range(rng.randint(1, 9))]
            tokens += new
            history.extend(new)
            assert history.length == len(tokens)
            want = _reference_propose(tokens, k, min_n, max_n)
            assert history.propose(k, min_n, max_n).tolist() == want, (tokens, k, min_n, max_n)
            assert propose(tokens, k, min_n, max_n).tolist() == want
