"""Speculative decoding (issue 15, in progress): the `--speculative-config` description (config.py), the
n-gram prompt-lookup proposer (ngram.py, host numpy) and lossless verification of proposals against
the target distribution (rejection.py, jnp). Not yet wired into the scheduler and the step."""
