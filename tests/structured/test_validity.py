"""Validity regardless of the model: the random-weight default model at temperature 1.0 samples 200
outputs per constraint, and every one of them matches it (JSON schemas checked with `jsonschema`,
regexes with `re.fullmatch`, choices by membership, an arithmetic Lark grammar with Python's parser).

Every schema bounds its strings, arrays, numbers (range, and a binary-exact multipleOf where
the fraction would be unbounded) and properties, so a model that picks tokens at random still
reaches the end of the grammar within max_tokens."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import types

import jsonschema
import pytest

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.structured import StructuredOutputs

SAMPLES = 200
PROMPTS = 4                 # x n = 50 samples each (PROMPTS_TEXT)
MAX_TOKENS = 400

NAME = {"type": "string", "maxLength": 5}
COORD = {"type": "integer", "minimum": -99, "maximum": 99}
SCHEMAS = {
    "flat_required": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                      "required": ["name", "age"], "additionalProperties": False},
    "nested_objects": {"type": "object", "additionalProperties": False, "required": ["user"],
                       "properties": {"user": {"type": "object", "additionalProperties": False,
                                               "required": ["id", "address"],
                                               "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                                              "address": {"type": "object",
                                                                          "additionalProperties": False,
                                                                          "required": ["city"],
                                                                          "properties": {"city": NAME,
                                                                                         "zip": NAME}}}}}},
    "bounded_array": {"type": "object", "additionalProperties": False, "required": ["tags"],
                      "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 4}}},
    "enums": {"type": "object", "additionalProperties": False, "required": ["color", "size"],
              "properties": {"color": {"enum": ["red", "green", "blue"]},
                             "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
                             "level": {"enum": [1, 2, 3, None]}}},
    "number_ranges": {"type": "object", "additionalProperties": False, "required": ["score", "ratio", "temp"],
                      "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 100},
                                     "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.125},
                                     "temp": {"type": "number", "exclusiveMinimum": -40, "maximum": 50.5,
                                              "multipleOf": 0.5}}},
    "optional_fields": {"type": "object", "additionalProperties": False, "required": ["id"],
                        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99999}, "nick": NAME, "admin": {"type": "boolean"},
                                       "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"}}},
    "string_patterns": {"type": "object", "additionalProperties": False, "required": ["date", "code"],
                        "properties": {"date": {"type": "string", "pattern": "^[0-9]{2}/[0-9]{2}$"},
                                       "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}},
    "refs": {"$defs": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                                 "properties": {"x": COORD, "y": COORD}}},
             "type": "object", "additionalProperties": False, "required": ["start"],
             "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 2,
                         "items": {"type": "object", "additionalProperties": False, "required": ["k", "v"],
                                   "properties": {"k": NAME, "v": {"type": ["integer", "null"], "minimum": -9, "maximum": 99}}}},
    "any_of": {"type": "object", "additionalProperties": False, "required": ["value"],
               "properties": {"value": {"anyOf": [{"type": "integer", "minimum": -99, "maximum": 999}, NAME, {"type": "boolean"}]},
                              "const": {"const": "fixed"}}},
}

ARITHMETIC = r"""
start: expr
expr: term (OP term){0,2}
term: NUMBER | "(" inner ")"
inner: NUMBER (OP NUMBER){0,2}
OP: "+" | "-" | "*" | "/"
NUMBER: /[1-9][0-9]?/
"""


REGEX = r"[a-z]{2,5}-[0-9]{1,4}(\.[A-Z]{1,3})?"
CHOICES = ["yes", "no", "maybe so", "I don't know", "是"]
PROMPTS_TEXT = ["Answer in JSON.", "Hello", "今天天气很好", "def f(x):"]


def _constraints() -> dict[str, StructuredOutputs]:
    out = {f"json:{name}": StructuredOutputs(json=schema) for name, schema in SCHEMAS.items()}
    out.update({"regex": StructuredOutputs(regex=REGEX), "choice": StructuredOutputs(choice=CHOICES),
                "lark": StructuredOutputs(grammar=ARITHMETIC)})
    return out


def _generate_samples() -> dict[str, list[dict]]:
    """Constraint name -> its 200 outputs (text, finish_reason). Every constraint's requests go into
    one generate call, so the batch stays full until the very end (one tail of long samples, not one
    per constraint)."""
    from conftest import ENGINE  # this directory's: the child never loads tests/conftest.py
    from jaxserve.entrypoints.llm import LLM

    prompts, params, names = [], [], []
    for k, (name, spec) in enumerate(_constraints().items()):
        for prompt in PROMPTS_TEXT:
            prompts.append(prompt)
            params.append(SamplingParams(n=SAMPLES // PROMPTS, temperature=1.0, max_tokens=MAX_TOKENS, seed=k,
                                         structured_outputs=spec))
            names.append(name)
    out: dict[str, list[dict]] = {}
    for name, result in zip(names, LLM(show_progress=False, **ENGINE).generate(prompts, params)):
        out.setdefault(name, []).extend({"text": o.text, "finish_reason": o.finish_reason} for o in result.outputs)
    return out


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> dict[str, list]:
    """The 2,600 samples, generated by this file run as a script with XLA's own flags. This is the
    suite's one file whose time is running programs, not compiling them: at the suite's compile-speed
    flags (tests/conftest.py) a step of 64 sampled rows over the 151,936-token vocabulary takes 295 ms
    against 83 ms (Xeon Sapphire Rapids), and the whole file took 440 s in-process, ~115 s this way
    (a fresh process's 47 s warm-up included)."""
    from own_process import child_env  # here: the child runs this file with only the repository on its path

    path = tmp_path_factory.mktemp("validity") / "samples.json"
    env = child_env(XLA_FLAGS="", JAX_DEFAULT_MATMUL_PRECISION="highest")  # XLA's flags, the suite's precision
    proc = subprocess.run([sys.executable, __file__, str(path)], env=env, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: [types.SimpleNamespace(**o) for o in outputs]
            for name, outputs in json.loads(path.read_text()).items()}


def _samples(samples: dict[str, list], name: str) -> list:
    outputs = samples[name]
    assert len(outputs) == SAMPLES
    for o in outputs:
        assert o.finish_reason == "stop", (o.finish_reason, o.text)  # the grammar ended, not max_tokens
    return outputs


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_samples_all_validate(samples, name):
    schema = SCHEMAS[name]
    texts = set()
    for o in _samples(samples, f"json:{name}"):
        jsonschema.validate(json.loads(o.text), schema)
        texts.add(o.text)
    assert len(texts) >= 10  # temperature 1.0 explores the schema, not one fixed answer


def test_regex_samples_fullmatch(samples):
    for o in _samples(samples, "regex"):
        assert re.fullmatch(REGEX, o.text), o.text


def test_choice_samples_are_members(samples):
    outputs = _samples(samples, "choice")
    assert {o.text for o in outputs} <= set(CHOICES)
    assert len({o.text for o in outputs}) >= 3


def _arithmetic_ok(node: ast.AST) -> bool:
    if isinstance(node, ast.Expression):
        return _arithmetic_ok(node.body)
    if isinstance(node, ast.BinOp):
        return (isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div))
                and _arithmetic_ok(node.left) and _arithmetic_ok(node.right))
    return isinstance(node, ast.Constant) and isinstance(node.value, int)


def test_lark_grammar_samples_parse(samples):
    for o in _samples(samples, "lark"):
        assert re.fullmatch(r"[0-9+\-*/()]+", o.text), o.text
        assert _arithmetic_ok(ast.parse(o.text, mode="eval")), o.text


if __name__ == "__main__":  # the samples fixture's child process: python test_validity.py OUT.json
    with open(sys.argv[1], "w") as f:
        json.dump(_generate_samples(), f)
