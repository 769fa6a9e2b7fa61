"""A parsed request's output constraint -> its compiled grammar, or a 400 naming the field.

Runs on a worker thread (compiling can take a while for a large schema) before the request is
submitted, so a constraint that does not compile never reaches the engine. With a reasoning parser
the grammar lets the model think first (structured/reasoning.py).
"""

from __future__ import annotations

from typing import Any

from jaxserve.server.errors import bad_request
from jaxserve.server.protocol import GenerationRequest, ModelContext
from jaxserve.structured.compiler import GrammarCompiler, GrammarError
from jaxserve.structured.guide import CompiledGrammar
from jaxserve.structured.reasoning import reasoning_prefix
from jaxserve.structured.spec import compose


def request_grammar(compiler: GrammarCompiler, gen: GenerationRequest, ctx: ModelContext) -> CompiledGrammar:
    prefix = reasoning_prefix(ctx.reasoning_parser, gen.prompt_text) if gen.kind == "chat" else ""
    field: Any = gen.structured_field
    try:
        if gen.forces_tool_calls:
            field = "tool_choice"
            lark = ctx.tool_parser.grammar(gen.tools, gen.tool_choice, gen.parallel_tool_calls,
                                           ctx.tool_tags.tokens)
            return compiler.compile_text(compose({"lark_grammar": lark}, prefix), field)
        return compiler.compile(gen.params.structured_outputs, prefix, field=field)
    except GrammarError as e:
        raise bad_request(str(e), field) from None
