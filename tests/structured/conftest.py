"""One offline LLM on the embedded default model (random weights, the real Qwen vocabulary) for the
structured-output tests: big enough batches that 200 samples of a schema run in a few steps each."""

from __future__ import annotations

import pytest

from jaxserve.entrypoints.llm import LLM

ENGINE = dict(max_num_seqs=64, max_num_batched_tokens=256, max_model_len=512, token_buckets=(16, 64, 256),
              seq_buckets=(16, 64), num_kv_pages=1024, page_size=16)


@pytest.fixture(scope="session")
def llm() -> LLM:
    return LLM(show_progress=False, **ENGINE)
