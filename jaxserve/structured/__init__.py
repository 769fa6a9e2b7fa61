"""Structured output: constraints (spec.py), their compilation and cache (compiler.py), per-sequence
grammar state and the step's token bitmask (guide.py), and the reasoning prefix (reasoning.py)."""

from jaxserve.structured.compiler import GrammarCompiler, GrammarError
from jaxserve.structured.spec import StructuredOutputs

__all__ = ["GrammarCompiler", "GrammarError", "StructuredOutputs"]
