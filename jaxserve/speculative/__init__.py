"""Speculative decoding: the `--speculative-config` description (config.py), the n-gram prompt-lookup
proposer (ngram.py, host numpy) that the scheduler asks for drafts, verification of one-hot drafts by
sampling their rows (accept.py, host) and the counters (stats.py)."""
