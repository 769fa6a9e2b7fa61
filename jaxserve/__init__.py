"""jaxserve: a JAX/XLA serving engine for decoder-only language models."""

from jaxserve.host_memory import tune_malloc

tune_malloc()  # before jax starts its threads: see host_memory.py
