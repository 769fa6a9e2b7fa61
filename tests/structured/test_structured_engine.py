"""Structured output through the engine: constrained and unconstrained requests batched together get
what they get alone (seeded), async scheduling gives what the synchronous engine gives, nothing
compiles after warm-up, and the grammar's end, max_tokens, n > 1, logprobs and stop strings
behave as they do without a grammar."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from jaxserve.entrypoints.llm import LLM
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.structured import GrammarCompiler, GrammarError, StructuredOutputs


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
CODE = r"[A-Z]{2}-[0-9]{2,4}"
CHOICES = ["alpha", "beta", "gamma delta"]


def _synchronous(llm: LLM, prompts, params):
    """The same engine with async scheduling off (only EngineCore.step reads the flag, and the
    core is idle between generate calls): the synchronous engine's outputs, without a second warm-up."""
    core = llm.core
    cfg = core.engine_cfg
    assert cfg.async_scheduling and not core.has_work()
    core.engine_cfg = dataclasses.replace(cfg, async_scheduling=False)
    try:
        return llm.generate(prompts, params)
    finally:
        core.engine_cfg = cfg


def _mixed() -> list[tuple[str, SamplingParams]]:
    """Constrained (JSON, regex, choice; sampled and greedy) and unconstrained requests.

    Sampled rows that may pick almost any of the 151k tokens use top_k: the random model's next-token
    distribution is nearly uniform, so a bin is ~7e-6 of the CDF wide, and the ~1e-6 rounding noise a
    different batch shape (M of the matmuls) leaves in the logits moves a draw into the next bin ~8 %
    of the time on AVX-512 hosts. Bit-identical logits across batch shapes is not what is tested here."""
    s = StructuredOutputs
    return [
        ("Give me a person.", SamplingParams(n=2, temperature=1.0, top_k=50, seed=7, max_tokens=40,
                                             structured_outputs=s(json=PERSON))),
        ("Once upon a time", SamplingParams(temperature=1.0, top_k=50, seed=8, max_tokens=12, ignore_eos=True)),
        ("A code:", SamplingParams(temperature=0.9, top_p=0.9, seed=9, max_tokens=20, structured_outputs=s(regex=CODE))),
        ("Pick one", SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=s(choice=CHOICES))),
        ("Hello there", SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)),
        ("JSON please", SamplingParams(temperature=1.0, top_k=50, seed=10, max_tokens=60,
                                       structured_outputs=s(json_object=True))),
    ]


def _tokens(outputs) -> list[list[list[int]]]:
    return [[o.token_ids for o in r.outputs] for r in outputs]


def test_batched_equals_alone_and_async_equals_sync(llm):
    requests = _mixed()
    prompts, params = zip(*requests)
    batched = {True: llm.generate(list(prompts), list(params)),
               False: _synchronous(llm, list(prompts), list(params))}
    alone = [llm.generate([p], sp)[0] for p, sp in requests]
    assert _tokens(batched[True]) == _tokens(alone)
    assert _tokens(batched[False]) == _tokens(alone)
    person = [o.text for o in batched[True][0].outputs]
    for text in person:
        jsonschema.validate(json.loads(text), PERSON)
    assert re.fullmatch(CODE, batched[True][2].outputs[0].text)
    assert batched[True][3].outputs[0].text in CHOICES
    assert isinstance(json.loads(batched[True][5].outputs[0].text), dict)
    assert llm.core.runner.compilations_after_warmup == 0


def test_async_constrained_steps_overlap_the_forward_with_the_previous_step(llm):
    """With async scheduling a constrained step dispatches its forward before the previous step's
    ids are applied: the forward of step n+1 is on the device while the host fills the masks."""
    core = llm.core
    log: list[str] = []
    forward, sample, fetch = core.runner.forward, core.runner.sample, core.runner.fetch

    def traced(name, fn):
        def call(*args, **kwargs):
            log.append(name)
            return fn(*args, **kwargs)
        return call

    core.runner.forward, core.runner.sample, core.runner.fetch = (
        traced("forward", forward), traced("sample", sample), traced("fetch", fetch))
    try:
        llm.generate(["x"], SamplingParams(temperature=1.0, seed=1, max_tokens=30,
                                                      structured_outputs=StructuredOutputs(regex="[a-z]{20}")))
    finally:
        core.runner.forward, core.runner.sample, core.runner.fetch = forward, sample, fetch
    # After the first step: forward(n+1), fetch(n), sample(n+1) -- never a fetch before the next forward.
    assert log[:3] == ["forward", "sample", "forward"]
    assert "forward fetch sample" in " ".join(log)
    assert "sample fetch forward" not in " ".join(log)


def test_max_tokens_cuts_the_json_with_length(llm):
    out = llm.generate(["x"], SamplingParams(temperature=1.0, seed=3, max_tokens=4,
                                                       structured_outputs=StructuredOutputs(json=PERSON)))
    o = out[0].outputs[0]
    assert o.finish_reason == "length"
    assert len(o.token_ids) == 4
    assert o.text.startswith('{"name": "')
    with pytest.raises(json.JSONDecodeError):
        json.loads(o.text)


def test_grammar_end_stops_even_with_ignore_eos_and_min_tokens(llm):
    """The grammar decides where a constrained output ends: min_tokens and ignore_eos cannot push
    past it (EOS is the only token it allows there)."""
    for extra in (dict(ignore_eos=True), dict(min_tokens=30)):
        out = llm.generate(["x"], SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=50,
                                                           structured_outputs=StructuredOutputs(choice=CHOICES), **extra))
        for o in out[0].outputs:
            assert o.finish_reason == "stop" and o.text in CHOICES, (extra, o)
            assert len(o.token_ids) < 10


def test_n_samples_are_distinct_valid_and_logprobs_cover_only_allowed_tokens(llm):
    params = SamplingParams(n=6, temperature=1.0, seed=11, max_tokens=12, logprobs=5,
                            structured_outputs=StructuredOutputs(regex="[0-9]{3}"))
    out = llm.generate(["digits"], params)[0].outputs
    assert len({o.text for o in out}) > 1
    for o in out:
        assert re.fullmatch("[0-9]{3}", o.text) and o.finish_reason == "stop"
        assert len(o.logprobs) == len(o.token_ids) and all(lp <= 0 for lp in o.logprobs)
    # The logprobs are of the masked distribution: at the last digit the alternatives are digits only.
    from jaxserve.core.request import Request

    core = llm.core
    grammar = llm.grammars.compile(StructuredOutputs(regex="[0-9]{3}"))
    core.add_request(Request("lp", llm.tokenizer.encode("digits"), params, llm.tokenizer.eos_token_ids, grammar=grammar))
    tops = []
    while core.has_work():
        tops += [e.top_logprobs for e in core.step() if e.token_id is not None and e.top_logprobs is not None]
    assert tops
    for top in tops:
        real = [(t, lp) for t, lp in top if t >= 0]
        assert real and all(lp > -float("inf") for _, lp in real)
        for t, _ in real:
            text = llm.tokenizer.decode([t])
            assert re.fullmatch("[0-9]+", text) or t in llm.tokenizer.eos_token_ids, text


def test_stop_strings_end_a_constrained_sample(llm):
    out = llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=30, stop=["5"],
                                                       structured_outputs=StructuredOutputs(regex="12345678")))
    o = out[0].outputs[0]
    assert o.text == "1234" and o.finish_reason == "stop"


def test_compiled_grammars_are_cached_by_text(llm):
    compiler = llm.grammars
    first = compiler.compile(StructuredOutputs(json=PERSON))
    assert compiler.compile(StructuredOutputs(json=json.loads(json.dumps(PERSON)))) is first
    assert compiler.compile(StructuredOutputs(regex=CODE)) is not first


@pytest.mark.parametrize("spec, words", [
    (StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
    (StructuredOutputs(json={"$ref": "#/$defs/missing"}), "missing"),
    (StructuredOutputs(regex="[a-z"), "regex"),
    (StructuredOutputs(grammar="start: expr\nexpr: NUMBER +"), "grammar"),
])
def test_bad_constraints_raise_grammar_errors_naming_the_field(llm, spec, words):
    with pytest.raises(GrammarError) as err:
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert words in str(err.value)
    assert not llm.core.has_work()


def test_engine_refuses_structured_outputs_without_a_compiled_grammar(llm):
    from jaxserve.core.request import Request

    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="a"))
    with pytest.raises(ValueError, match="compiled grammar"):
        llm.core.add_request(Request("r", [1, 2], params))


def test_a_constraint_too_large_or_too_slow_to_compile_is_refused(llm):
    from jaxserve.structured.spec import MAX_GRAMMAR_CHARS

    with pytest.raises(GrammarError, match="at most"):
        llm.grammars.compile(StructuredOutputs(regex="a" * (MAX_GRAMMAR_CHARS + 1)))
    slow = GrammarCompiler(llm.tokenizer.hf, llm.core.model_cfg.vocab_size, llm.tokenizer.eos_token_ids,
                           timeout_s=1e-4)
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}x$"}
                                            for i in range(400)}}
    with pytest.raises(GrammarError, match="took longer than"):
        slow.compile(StructuredOutputs(json=big), field="response_format")
    slow.close()


def test_speculation_with_grammars_gives_the_plain_engines_outputs(llm):
    """n-gram drafts of constrained rows are cut where the grammar refuses them and each draft row
    samples under the mask of the state after the drafts before it: the outputs (seeded) are the
    plain engine's. A periodic regex makes prompt lookup propose from the output itself."""
    spec_llm = LLM(show_progress=False, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                   max_num_seqs=16, max_num_batched_tokens=64, max_model_len=512, token_buckets=(16, 64),
                   seq_buckets=(16,), num_kv_pages=256, page_size=16)
    s = StructuredOutputs
    periodic = ("Repeat", SamplingParams(temperature=1.0, top_k=50, seed=12, max_tokens=40,
                                         structured_outputs=s(regex='(\\{"a": 1\\}, ){8}')))
    requests = _mixed() + [periodic, ("x", SamplingParams(temperature=0.0, max_tokens=30, stop=["5"],
                                                          structured_outputs=s(regex="(1234567)+")))]
    prompts, params = zip(*requests)
    expected = llm.generate(list(prompts), list(params))
    got = spec_llm.generate(list(prompts), list(params))
    assert _tokens(got) == _tokens(expected)
    assert [[o.text for o in r.outputs] for r in got] == [[o.text for o in r.outputs] for r in expected]
    assert got[-1].outputs[0].text == "1234" and got[-1].outputs[0].finish_reason == "stop"
    stats = spec_llm.core.scheduler.spec_stats
    before = stats.copy()
    alone = spec_llm.generate([periodic[0]], periodic[1])
    assert _tokens(alone) == _tokens(expected[-2:-1])
    assert stats.since(before).num_accepted_tokens > 0  # the constrained row's drafts were accepted
    assert spec_llm.core.runner.compilations_after_warmup == 0
