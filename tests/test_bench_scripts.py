"""The benchmark tooling: bench_serving's load generator and metric arithmetic against a local
streaming stub (the stub stands in for a server on purpose: it is the client being tested),
roofline's byte / FLOP counting (per step and per workload) against hand-computed values,
bench_vs_peers' shared output lengths, static-batch counting, rate selection and report, its
llama-server peer (command line, request body, skip path, GGUF cache; no binary needed), and
bench_prefix_cache's arithmetic plus one smoke run against a real `jaxserve serve`."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_common  # noqa: E402
import bench_serving as bs  # noqa: E402
import roofline as rl  # noqa: E402

FIRST_DELAY = 0.05  # seconds the stub waits before the first chunk
ITL = 0.01          # seconds between the stub's chunks


# ----------------------------------------------------------------------------- stub server

class StubState:
    def __init__(self) -> None:
        self.first_delay = FIRST_DELAY
        self.itl = ITL
        self.fail_every = 0  # fail the k-th, 2k-th, ... request with HTTP 500 (0 = never)
        self.textless_every = 0  # the k-th, 2k-th, ... request's only token is special: no text, then a finish
        self.unfinished_every = 0  # the k-th, 2k-th, ... stream ends with neither text nor a finish
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self.lock = threading.Lock()

    def reset(self) -> None:
        self.__init__()


def make_stub_app(state: StubState):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def handle(request: Request, chat: bool):
        body = await request.json()
        with state.lock:
            state.bodies.append(body)
            index = len(state.bodies)
        if state.fail_every and index % state.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        n_out = int(body["max_tokens"])
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        usage = body.get("stream_options", {}).get("include_usage", False)

        textless = state.textless_every and index % state.textless_every == 0
        unfinished = state.unfinished_every and index % state.unfinished_every == 0
        if textless or unfinished:
            n_out = 1

        def chunk(text: str, finish: str | None = None) -> str:
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
            return "data: " + json.dumps({"id": "x", "choices": [choice]}) + "\n\n"

        async def stream():
            with state.lock:
                state.in_flight += 1
                state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
            try:
                if chat:  # a role-only first chunk carries no token and must not count
                    yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
                await asyncio.sleep(state.first_delay)
                for i in range(n_out):
                    if i:
                        await asyncio.sleep(state.itl)
                    if textless:
                        yield chunk("", "stop")
                    elif not unfinished:
                        yield chunk(f" t{i}")
                if usage:
                    u = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
                    yield "data: " + json.dumps({"id": "x", "choices": [], "usage": u}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                with state.lock:
                    state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def completions(request: Request):
        return await handle(request, chat=False)

    async def chat(request: Request):
        return await handle(request, chat=True)

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.fixture(scope="module")
def stub():
    import uvicorn

    state = StubState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_stub_app(state), log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "stub server did not start"
        time.sleep(0.02)
    yield state, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A small byte-level BPE tokenizer trained on this repository's text, saved as an HF dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    tok.train_from_iterator([bs.read_corpus(max_chars=20_000)], trainer)
    out = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(out)
    return str(out)


def _cfg(base_url: str, tokenizer_dir: str, **kw) -> bs.BenchConfig:
    defaults = dict(base_url=base_url, model="stub", tokenizer=tokenizer_dir, num_requests=6,
                    prompt_len_min=5, prompt_len_max=20, output_len_min=3, output_len_max=6,
                    prompt_as="ids", seed=1, timeout=20.0, corpus_max_chars=20_000)
    defaults.update(kw)
    return bs.BenchConfig(**defaults)


# ----------------------------------------------------------------------------- arithmetic

def test_percentile_matches_hand_computed_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert bench_common.percentile(xs, 50) == pytest.approx(2.5)   # pos 1.5 between 2 and 3
    assert bench_common.percentile(xs, 95) == pytest.approx(3.85)  # pos 2.85
    assert bench_common.percentile(xs, 99) == pytest.approx(3.97)  # pos 2.97
    assert bench_common.percentile(xs, 0) == 1.0 and bench_common.percentile(xs, 100) == 4.0
    assert bench_common.percentile([7.0], 99) == 7.0
    assert math.isnan(bench_common.percentile([], 50))
    rng = np.random.default_rng(0).random(101)
    assert bench_common.percentile(rng, 37) == pytest.approx(np.percentile(rng, 37))
    with pytest.raises(ValueError, match="q must be"):
        bench_common.percentile(xs, 101)


def test_compute_metrics_goodput_throughput_and_tpot():
    R = bs.RequestResult
    results = [
        R(ok=True, prompt_len=10, output_len_requested=11, output_tokens=11, ttft=0.1, e2e=1.1),   # tpot 100 ms: good
        R(ok=True, prompt_len=20, output_len_requested=11, output_tokens=11, ttft=3.0, e2e=4.0),   # ttft 3000 ms: bad
        R(ok=True, prompt_len=30, output_len_requested=11, output_tokens=11, ttft=0.5, e2e=3.5),   # tpot 300 ms: bad
        R(ok=True, prompt_len=40, output_len_requested=1, output_tokens=1, ttft=0.2, e2e=0.2,
          prompt_tokens_reported=44),                                                             # no tpot: good
        R(ok=False, prompt_len=50, output_len_requested=5, error="HTTP 500: boom"),
    ]
    assert results[0].tpot == pytest.approx(0.1)
    assert results[2].tpot == pytest.approx(0.3)
    assert math.isnan(results[3].tpot)
    m = bs.compute_metrics(results, duration=2.0, slo_ttft_ms=2000, slo_tpot_ms=200)
    assert (m["completed"], m["failed"], m["good_requests"]) == (4, 1, 2)
    assert m["errors"] == {"HTTP 500: boom": 1}
    assert m["goodput"] == pytest.approx(1.0)
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["total_output_tokens"] == 34
    assert m["output_throughput"] == pytest.approx(17.0)
    assert m["total_input_tokens"] == 10 + 20 + 30 + 44  # usage's prompt_tokens wins when reported
    assert m["total_token_throughput"] == pytest.approx((104 + 34) / 2.0)
    assert m["ttft_ms"]["p50"] == pytest.approx(350.0)  # sorted 100, 200, 500, 3000
    # TPOT of the first three: 100, 100, 300 ms; the 1-token request has none and is left out.
    assert m["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(500.0 / 3)
    with pytest.raises(ValueError, match="duration"):
        bs.compute_metrics(results, duration=0.0, slo_ttft_ms=1, slo_tpot_ms=1)


def test_arrival_times_poisson_and_burst():
    assert np.all(bs.arrival_times(5, math.inf, 0) == 0)
    a = bs.arrival_times(2000, 50.0, seed=3)
    assert np.array_equal(a, bs.arrival_times(2000, 50.0, seed=3))
    assert a[0] == 0 and np.all(np.diff(a) >= 0)
    assert np.mean(np.diff(a)) == pytest.approx(1 / 50.0, rel=0.1)


def test_config_validation_names_the_problem():
    with pytest.raises(ValueError, match="prompt_as='ids' needs endpoint='completions'"):
        bs.BenchConfig(base_url="x", model="m", endpoint="chat", prompt_as="ids").validate()
    with pytest.raises(ValueError, match="prompt_len_min"):
        bs.BenchConfig(base_url="x", model="m", prompt_len_min=10, prompt_len_max=5).validate()
    with pytest.raises(ValueError, match="request_rate"):
        bs.BenchConfig(base_url="x", model="m", request_rate=0).validate()


def test_prompts_are_deterministic_and_have_the_drawn_lengths(tokenizer_dir):
    tok = bs.load_tokenizer(tokenizer_dir)
    cfg = _cfg("http://unused", tokenizer_dir, num_requests=8, prompt_len_min=30, prompt_len_max=60)
    a, b = bs.build_prompts(cfg, tok), bs.build_prompts(cfg, tok)
    assert [p.prompt for p in a] == [p.prompt for p in b]
    assert all(len(p.prompt) == p.prompt_len and 30 <= p.prompt_len <= 60 for p in a)
    assert len({p.prompt_len for p in a}) > 1
    other = bs.build_prompts(_cfg("http://unused", tokenizer_dir, num_requests=8, seed=2), tok)
    assert [p.prompt for p in other] != [p.prompt for p in a]
    text = bs.build_prompts(_cfg("http://unused", tokenizer_dir, num_requests=4, prompt_as="text"), tok)
    for p in text:
        assert isinstance(p.prompt, str)
        assert len(tok.encode(p.prompt, add_special_tokens=False)) == p.prompt_len


# ----------------------------------------------------------------------------- against the stub

def test_run_benchmark_measures_tokens_and_latencies(stub, tokenizer_dir, tmp_path):
    state, url = stub
    state.reset()
    cfg = _cfg(url, tokenizer_dir, json_out=str(tmp_path / "r.json"), plot_dir=str(tmp_path / "plots"))
    report = bs.run_benchmark(cfg)
    assert (report["completed"], report["failed"]) == (6, 0)
    reqs = report["requests"]
    assert sorted(len(b["prompt"]) for b in state.bodies) == sorted(r["prompt_len"] for r in reqs)
    assert all(b["ignore_eos"] is True and b["stream"] is True for b in state.bodies)
    for r in reqs:
        assert r["output_tokens"] == r["output_len_requested"]
        assert 3 <= r["output_tokens"] <= 6
        assert r["ttft"] >= FIRST_DELAY
        assert len(r["itl"]) == r["output_tokens"] - 1
        # The stub sleeps ITL between chunks, so the stream cannot end sooner.
        assert r["e2e"] >= FIRST_DELAY + ITL * (r["output_tokens"] - 1)
        assert sum(r["itl"]) <= r["e2e"] - r["ttft"] + 1e-9
        assert r["tpot"] == pytest.approx((r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1))
    assert report["total_output_tokens"] == sum(b["max_tokens"] for b in state.bodies)
    assert report["total_input_tokens"] == sum(len(b["prompt"]) for b in state.bodies)
    assert report["output_throughput"] == pytest.approx(report["total_output_tokens"] / report["duration_s"])
    assert report["good_requests"] == 6
    assert report["ttft_ms"]["p50"] >= FIRST_DELAY * 1000
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["total_output_tokens"] == report["total_output_tokens"]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "itl_hist.png", "latency_timeline.png", "tpot_hist.png", "ttft_hist.png"]


def test_chat_text_without_usage_counts_chunks_and_respects_concurrency(stub, tokenizer_dir):
    state, url = stub
    state.reset()
    cfg = _cfg(url, tokenizer_dir, endpoint="chat", prompt_as="text", include_usage=False,
               max_concurrency=2, length_control="none")
    report = bs.run_benchmark(cfg)
    assert report["completed"] == 6
    assert state.peak_in_flight == 2
    assert all("stream_options" not in b and "ignore_eos" not in b for b in state.bodies)
    for r in report["requests"]:
        assert r["output_tokens"] == r["output_len_requested"]  # counted from chunks; role chunk ignored
        assert r["prompt_tokens_reported"] is None


def test_failures_and_slo_are_counted(stub, tokenizer_dir):
    state, url = stub
    state.reset()
    state.fail_every = 3
    # TTFT is always >= the stub's first delay, so an SLO below it makes every request "bad".
    cfg = _cfg(url, tokenizer_dir, max_concurrency=1, slo_ttft_ms=FIRST_DELAY * 1000 / 2)
    report = bs.run_benchmark(cfg)
    assert (report["completed"], report["failed"]) == (4, 2)
    assert list(report["errors"]) == ['HTTP 500: {"error":{"message":"injected failure"}}']
    assert report["good_requests"] == 0 and report["goodput"] == 0.0


def test_a_stream_of_special_tokens_only_completes_and_one_without_a_finish_fails(stub, tokenizer_dir):
    """A random model may answer with an EOS (or other special tokens) first: no text, a finish
    reason. That request completed, its first token at its finish; a stream with neither is broken."""
    state, url = stub
    state.reset()
    state.textless_every, state.unfinished_every = 2, 5
    report = bs.run_benchmark(_cfg(url, tokenizer_dir, num_requests=6, max_concurrency=1))
    assert (report["completed"], report["failed"]) == (5, 1)
    assert list(report["errors"]) == ["stream ended without any text or finish_reason"]
    assert report["ttft_ms"]["max"] >= FIRST_DELAY * 1000


def test_global_timeout_bounds_the_run(stub, tokenizer_dir):
    state, url = stub
    state.reset()
    state.itl = 0.5  # 3..6 tokens -> every stream needs >= 1 s
    t = time.monotonic()
    report = bs.run_benchmark(_cfg(url, tokenizer_dir, timeout=0.4))
    assert time.monotonic() - t < 5
    assert report["completed"] == 0 and report["failed"] == 6
    assert all("global timeout" in e for e in report["errors"])


# ----------------------------------------------------------------------------- roofline

TINY = {
    "model_type": "qwen3", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16, "vocab_size": 32,
    "tie_word_embeddings": True, "torch_dtype": "float32",
}


def test_roofline_decode_and_prefill_arithmetic(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    r = rl.roofline(path, batch=2, context_len=10, bw=1000.0, flops_rate=500.0)
    # per layer: q 8*2*4=64, k 32, v 32, o 64, mlp 3*8*16=384 -> 576 matmul params;
    # norms 8 + 8 + q_norm 4 + k_norm 4 = 24. Total 2*(576+24) + final norm 8 + tied embed 256 = 1464.
    assert r["total_params"] == 1464
    assert r["weight_bytes"] == 1464 * 4                 # tied: the embedding is read once, as lm_head
    # K and V per position: 2 * 2 layers * 1 kv head * head_dim 4 = 16 elements = 64 bytes.
    assert r["kv_read_bytes"] == 2 * 10 * 64                # 2 rows x 10 positions = 1280
    assert r["kv_write_bytes"] == 2 * 64                    # one new position per row = 128
    assert r["decode_bytes"] == 5856 + 1280 + 128
    # 2*576*2 layers*2 rows = 4608; attention 4*2 heads*4*10 ctx*2 layers*2 rows = 1280; lm_head 2*256*2 = 1024
    assert r["decode_flops"] == 4608 + 1280 + 1024
    # 7264 B / 1000 B/s = 7.264 s < 6912 FLOP / 500 FLOP/s = 13.824 s
    assert r["decode_time_memory_s"] == pytest.approx(7.264)
    assert r["decode_step_s"] == pytest.approx(13.824) and r["decode_bound"] == "compute"
    assert r["decode_tokens_per_s"] == pytest.approx(2 / 13.824)
    # prefill of 2 x 10 tokens: 2*576*2*20 = 46080; causal attention 4*2*4*2 layers*2 seqs*55 = 7040; lm_head 1024
    assert r["prefill_flops"] == 46080 + 7040 + 1024
    # weights 5856 + KV written for 20 tokens 20*16*4 = 1280
    assert r["prefill_bytes"] == 5856 + 1280


def test_roofline_untied_counts_lm_head_and_gathered_rows(tmp_path):
    cfg = dict(TINY, tie_word_embeddings=False, torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = rl.roofline(tmp_path, batch=1, context_len=1, bw=1.0, flops_rate=1e9)
    assert r["total_params"] == 1464 + 256
    # bf16 weights: layers 1200 + final norm 8 + lm_head 256 + 1 gathered embedding row of 8
    assert r["weight_bytes"] == (1200 + 8 + 256 + 8) * 2
    assert r["decode_bound"] == "memory"
    with pytest.raises(ValueError, match="mixture-of-experts"):
        (tmp_path / "config.json").write_text(json.dumps(dict(TINY, num_experts=8)))
        rl.roofline(tmp_path, 1, 1, 1.0, 1.0)
    with pytest.raises(ValueError, match="batch and context_len"):
        rl.roofline(tmp_path, 0, 1, 1.0, 1.0)


# ----------------------------------------------------------------------------- bench_vs_peers report

def test_marked_section_is_replaced_without_touching_the_rest(tmp_path):
    doc = tmp_path / "BENCH.md"
    start, end = "<!-- s -->", "<!-- e -->"
    bench_common.replace_marked_section(doc, start, end, "first", header="# Header")
    assert doc.read_text() == "# Header\n\n<!-- s -->\nfirst\n<!-- e -->\n"
    doc.write_text("# Header\n\nintro\n\n<!-- s -->\nfirst\n<!-- e -->\n\n## Other section\nkeep me\n")
    bench_common.replace_marked_section(doc, start, end, "second", header="# unused")
    assert doc.read_text() == "# Header\n\nintro\n\n<!-- s -->\nsecond\n<!-- e -->\n\n## Other section\nkeep me\n"
    doc.write_text("<!-- s -->\nno end marker\n")
    with pytest.raises(ValueError, match="unbalanced"):
        bench_common.replace_marked_section(doc, start, end, "x", header="")


def test_named_docs_sections_are_rewritten_independently(tmp_path):
    import bench_vs_peers as bvp

    doc = tmp_path / "BENCH.md"
    small, big = bvp.section_markers("bench-small"), bvp.section_markers("bench-105m")
    assert bvp.section_markers(None) == (bvp.MARK_START, bvp.MARK_END)
    assert len({*small, *big, bvp.MARK_START}) == 5
    bench_common.replace_marked_section(doc, *small, "small v1", header="# H")
    bench_common.replace_marked_section(doc, *big, "big v1", header="# H")
    bench_common.replace_marked_section(doc, *small, "small v2", header="# H")
    text = doc.read_text()
    assert "small v2" in text and "big v1" in text and "small v1" not in text


def test_peer_report_ratios_use_medians_and_the_best_peer():
    import bench_vs_peers as bvp

    def outcomes(*tputs):
        return [bvp.Outcome(output_throughput=t, total_token_throughput=2 * t, request_throughput=1.0) for t in tputs]

    systems = [
        bvp.System("jaxserve", measure=lambda: None, is_jaxserve=True, outcomes=outcomes(90, 100, 400)),
        bvp.System("static 1", measure=lambda: None, outcomes=outcomes(50, 50, 10)),
        bvp.System("static 16", measure=lambda: None, outcomes=outcomes(80, 70, 90)),
        bvp.System("serve", measure=lambda: None, error="needs fastapi"),
    ]
    rows = bvp.summarize_systems(systems)
    assert [r["output_throughput"] for r in rows[:3]] == [100, 50, 80]  # medians over the repeats
    meta = {"date": "d", "model": "m", "model_desc": "x", "workload": "w", "repeats": 3,
            "machine": {"cpu": "c"}, "command": "python scripts/bench_vs_peers.py"}
    md = bvp.markdown_report(rows, meta)
    assert "| static 1 | 50.0 | 100.0 |" in md and md.count("| 2.00 |") == 1  # 100 / 50
    assert "| static 16 | 80.0 |" in md and "| 1.25 |" in md                 # 100 / 80
    assert "jaxserve / best peer (static 16), output tok/s: 1.25" in md
    assert "not measured: serve — needs fastapi" in md


# ----------------------------------------------------------------------------- workload compute bound

def test_workload_flops_by_hand():
    # TINY: 576 matmul params per layer, 2 layers, 2 q heads x head_dim 4, lm_head 32 x 8 = 256.
    # Attention: 4 * 2 heads * 4 * 2 layers = 64 FLOPs per attended (query, key) pair.
    # Request A: 3 prompt tokens, 1 output token -> prefill only: tokens 3, pairs 1+2+3 = 6, one lm_head row.
    #   6912 + 384 + 512 = 7808
    # Request B: 2 prompt, 3 output -> prefill: tokens 2, pairs 3, one row: 4608 + 192 + 512 = 5312;
    #   decode: 2 fed-back tokens at positions 2, 3 attend 3 + 4 = 7 keys, two rows: 4608 + 448 + 1024 = 6080
    f = rl.workload_flops(TINY, [3, 2], [1, 3])
    assert (f["prefill"], f["decode"], f["total"]) == (7808 + 5312, 6080, 19200)
    assert f["lm_head"] == 2 * 256 * 4             # one row per sampled token: 1 + 3
    assert f["attention"] == 64 * (6 + 10)          # B runs 4 tokens through the layers: 1+2+3+4 pairs
    assert f["matmul"] == 2 * 2 * 576 * (3 + 4)
    assert (f["requests"], f["prompt_tokens"], f["output_tokens"]) == (2, 5, 4)
    # One request of P prompt tokens and 1 output token is exactly roofline's prefill of one sequence.
    assert rl.workload_flops(TINY, [10], [1])["total"] == rl.forward_flops(rl.model_shape(TINY), 10, 55, 1)["total"]
    with pytest.raises(ValueError, match="output lengths"):
        rl.workload_flops(TINY, [3], [1, 2])
    with pytest.raises(ValueError, match=">= 1 output"):
        rl.workload_flops(TINY, [3], [0])


def test_compute_bound_and_share_of_a_served_run():
    import bench_vs_peers as bvp

    bound = bvp.ComputeBound(TINY, flop_rate=1920.0)
    assert bound.seconds([3, 2], [1, 3]) == pytest.approx(10.0)  # 19200 FLOP / 1920 FLOP/s
    R = bs.RequestResult
    results = [R(ok=True, prompt_len=3, output_len_requested=1, output_tokens=1, ttft=0.5, e2e=0.5),
               R(ok=True, prompt_len=2, output_len_requested=3, output_tokens=3, ttft=1.0, e2e=3.0),
               R(ok=False, prompt_len=50, output_len_requested=9, error="HTTP 500")]
    report = bs.compute_metrics(results, duration=20.0, slo_ttft_ms=2000, slo_tpot_ms=2000)
    report["requests"] = [{**vars(r)} for r in results]
    o = bvp.outcome_from_report(report, bound)
    assert o.bound_s == pytest.approx(10.0)          # the failed request's tokens are not counted
    assert o.pct_of_bound == pytest.approx(50.0)     # 10 s bound / 20 s measured
    assert o.ttft_p99_ms == pytest.approx(995.0) and o.failed == 1


# ----------------------------------------------------------------------------- shared output lengths

def test_static_batching_and_the_load_generator_share_per_request_lengths(tokenizer_dir):
    import bench_vs_peers as bvp

    tok = bs.load_tokenizer(tokenizer_dir)
    cfg = _cfg("http://unused", tokenizer_dir, num_requests=7, prompt_as="text", output_len_min=3,
               output_len_max=9, seed=5)
    prompts = bs.build_prompts(cfg, tok)
    lens = [p.output_len for p in prompts]
    assert lens == [p.output_len for p in bs.build_prompts(cfg, tok)]   # same seed -> same lengths
    assert all(3 <= n <= 9 for n in lens) and len(set(lens)) > 1
    batches = bvp.static_batches(prompts, 3)
    assert [len(b.texts) for b in batches] == [3, 3, 1]
    assert [n for b in batches for n in b.output_lens] == lens
    assert [t for b in batches for t in b.texts] == [p.prompt for p in prompts]
    for spec in prompts:  # what the servers are asked for: the same length, forced
        body = bs.request_body(dataclasses.replace(cfg, length_control="ignore_eos"), spec)
        assert body["max_tokens"] == spec.output_len and body["ignore_eos"] is True
        hf_cfg = dataclasses.replace(cfg, length_control="hf_generation_config")
        hf = json.loads(bs.request_body(hf_cfg, spec)["generation_config"])
        assert hf["max_new_tokens"] == hf["min_new_tokens"] == spec.output_len


def test_hf_static_request_cap_is_at_least_one_batch():
    import bench_vs_peers as bvp

    assert bvp.static_requests(256, 1, 16) == 16
    assert bvp.static_requests(256, 64, 16) == 64   # a batch of 64 needs 64 requests
    assert bvp.static_requests(10, 64, 16) == 10
    assert bvp.static_requests(256, 16, None) == 256


@pytest.fixture(scope="module")
def tiny_hf_model(tokenizer_dir, tmp_path_factory):
    """A 1-layer transformers Qwen3 with random weights over the test tokenizer's vocabulary."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True,
                         max_position_embeddings=256, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("hf-tiny")
    Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_static_generate_counts_only_each_requests_own_tokens(tokenizer_dir, tiny_hf_model):
    import bench_vs_peers as bvp
    from roofline import _load_config

    tok = bs.load_tokenizer(tokenizer_dir)
    prompts = bs.build_prompts(_cfg("http://unused", tokenizer_dir, num_requests=5, prompt_as="text",
                                    output_len_min=2, output_len_max=7, seed=3), tok)
    lens = [p.output_len for p in prompts]
    bound = bvp.ComputeBound(_load_config(tiny_hf_model), flop_rate=1e9)
    o = bvp.StaticGenerate(tiny_hf_model, prompts, batch_size=2, bound=bound)()
    # Batches of 2 run to their longest request (generate raises otherwise); output is the sum of own lengths.
    assert o.out_tokens_per_req == pytest.approx(sum(lens) / 5)
    assert o.output_throughput * o.duration_s == pytest.approx(sum(lens))
    assert o.request_throughput * o.duration_s == pytest.approx(5)
    expected = bound.seconds([p.prompt_len for p in prompts], lens)
    assert o.bound_s == pytest.approx(expected) and o.pct_of_bound == pytest.approx(100 * expected / o.duration_s)


# ----------------------------------------------------------------------------- rates and the 80% run

def test_rates_saturation_and_the_fraction():
    import bench_vs_peers as bvp

    assert bvp.parse_rates("inf,2,1,0.5") == [math.inf, 2.0, 1.0, 0.5]
    assert bvp.main_rate([2.0, math.inf]) == math.inf and bvp.main_rate([2.0, 1.0]) == 2.0
    for bad in ("", "0", "inf,inf", "-1"):
        with pytest.raises(ValueError):
            bvp.parse_rates(bad)

    def run(req_s):
        return bvp.Outcome(output_throughput=1.0, total_token_throughput=1.0, request_throughput=req_s)

    systems = [bvp.System("hf", measure=lambda r: None, serving=True, outcomes=[run(9.0)]),
               bvp.System("jax", measure=lambda r: None, is_jaxserve=True, serving=True,
                          outcomes=[run(2.0), run(4.0), run(3.0)])]
    assert bvp.saturation_rate(systems) == 3.0          # jaxserve's median burst req/s, not a peer's
    assert bvp.frac_rate(3.0, 0.8) == pytest.approx(2.4)
    assert math.isnan(bvp.saturation_rate(systems[:1]))
    for sat, frac in ((math.nan, 0.8), (0.0, 0.8), (3.0, 0.0), (3.0, 1.5)):
        with pytest.raises(ValueError):
            bvp.frac_rate(sat, frac)


def test_fraction_runs_every_serving_system_per_repeat_at_one_rate():
    import argparse

    import bench_vs_peers as bvp

    seen: list[tuple[str, float]] = []

    def server(name: str, ttft_p99: float):
        # Stands in for a live server: records the rate it was driven at.
        def measure(rate: float) -> bvp.Outcome:
            seen.append((name, rate))
            return bvp.Outcome(output_throughput=10.0, total_token_throughput=20.0, request_throughput=rate,
                               ttft_p50_ms=ttft_p99 / 2, ttft_p99_ms=ttft_p99, tpot_p50_ms=5.0)
        return measure

    burst = [bvp.Outcome(output_throughput=1.0, total_token_throughput=1.0, request_throughput=r) for r in (5.0, 4.0)]
    systems = [bvp.System("jax", server("jax", 100.0), is_jaxserve=True, serving=True, outcomes=burst),
               bvp.System("hf-serve", server("hf", 300.0), serving=True, outcomes=burst[:1]),
               bvp.System("static", lambda r: pytest.fail("static batching has no arrival rate"), outcomes=burst)]
    a = argparse.Namespace(ttft_at_saturation_frac=0.8, rate_list=[math.inf, 1.0], repeats=2)
    frac = bvp.run_frac(systems, a)
    assert frac["saturation"] == pytest.approx(4.5) and frac["rate"] == pytest.approx(3.6)
    assert sorted(seen) == sorted([("jax", pytest.approx(3.6)), ("hf", pytest.approx(3.6))] * 2)
    assert [(r["system"], r["repeats"]) for r in frac["rows"]] == [("jax", 2), ("hf-serve", 2)]
    md = "\n".join(bvp.frac_lines(frac))
    assert "| hf-serve | 150.0 | 300.0 | 5.0 | 10.0 | 0 | 3.00 |" in md
    assert "TTFT p99 is lower than every peer's" in md
    assert bvp.run_frac(systems, argparse.Namespace(ttft_at_saturation_frac=0.0, rate_list=[math.inf], repeats=1)) is None
    skipped = bvp.run_frac(systems, argparse.Namespace(ttft_at_saturation_frac=0.8, rate_list=[1.0], repeats=1))
    assert "no burst" in skipped["skipped"]


def test_a_server_is_stopped_between_its_runs_and_shuts_down_promptly(tmp_path, monkeypatch):
    """Idle peers must not share the cores with another system's run: each server runs only during
    its own runs (SIGSTOP between them), and a stopped server still exits at the end."""
    import contextlib
    import subprocess

    import bench_vs_peers as bvp

    def state(proc: subprocess.Popen) -> str:  # R/S running or sleeping, T stopped
        return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    def settled(proc: subprocess.Popen) -> str:  # a process stops itself when it next runs
        deadline = time.monotonic() + 5
        while state(proc) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        return state(proc)

    during: list[str] = []

    def fake_run(cfg, prompts):  # the warm-up and each recorded run
        during.append(state(system.proc))
        return {"completed": 1, "failed": 0}

    monkeypatch.setattr(bvp.bs, "run_benchmark", fake_run)
    monkeypatch.setattr(bvp, "outcome_from_report", lambda report, bound=None: report)
    port = bench_common.free_port()
    cfg = bs.BenchConfig(base_url=f"http://127.0.0.1:{port}", model="m", tokenizer=str(tmp_path), num_requests=3)
    with contextlib.ExitStack() as stack:
        system = bvp.ServerSystem(stack, [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                                  port, "/", cfg, [None] * 3, tmp_path / "log", 30.0, None)
        for _ in range(2):
            system()
            assert settled(system.proc) == "T"
        proc = system.proc
        t0 = time.monotonic()
    assert len(during) == 3 and all(s in "RS" for s in during)
    assert proc.poll() is not None and time.monotonic() - t0 < 5  # SIGCONT first, then a clean SIGTERM


def test_peer_report_has_bound_sweep_and_fraction_tables():
    import bench_vs_peers as bvp

    def o(tput, req_s, pct=math.nan):
        return bvp.Outcome(output_throughput=tput, total_token_throughput=tput, request_throughput=req_s,
                           ttft_p99_ms=10.0, pct_of_bound=pct)

    jax = bvp.System("jax", lambda r: None, is_jaxserve=True, serving=True, outcomes=[o(100, 4, 40.0), o(120, 5, 60.0)],
                     sweep={1.0: [o(30, 1.0)]})
    static = bvp.System("static 16", lambda r: None, outcomes=[o(50, 2, 10.0)])
    rates = [math.inf, 1.0]
    rows = bvp.summarize_systems([jax, static])
    sweep = bvp.summarize_sweep([jax, static], rates)
    assert [(r["system"], r["offered"], r["output_throughput"]) for r in sweep] == [("jax", "burst", 110), ("jax", "1", 30)]
    meta = {"date": "d", "model": "m", "model_desc": "x", "workload": "w", "repeats": 2, "machine": {"cpu": "c"},
            "command": "c", "bound": {"gflop": 12.0, "prefill_gflop": 4.0, "decode_gflop": 8.0, "lm_head_gflop": 6.0,
                                      "gflops": 100.0, "seconds": 0.12, "rate_source": "measured"}}
    md = bvp.markdown_report(rows, meta, sweep, {"frac": 0.8, "skipped": "jaxserve failed"})
    assert "12.0 GFLOP" in md and "100.0 GFLOP/s" in md and "**0.12 s**" in md
    assert "| jax | 110.0 | 110.0 | 4.50 | — | 10.0 | — | — | — | 0 | 50.0 | — |" in md   # median of 40 and 60 %
    assert "| static 16 | 50.0 |" in md and "| 10.0 | 2.20 |" in md
    assert "jaxserve at 50.0% of the compute bound" in md
    assert "| jax | 1 | 1.00 | 30.0 |" in md and "| jax | burst | 4.50 | 110.0 |" in md
    assert "not measured — jaxserve failed" in md


def test_peer_cli_output_lengths_and_rates():
    import bench_vs_peers as bvp

    a = bvp.parse_args(["--output-len", "48"])
    assert (a.output_len_min, a.output_len_max, a.rate_list) == (48, 48, [math.inf])
    a = bvp.parse_args(["--output-len-min", "32", "--output-len-max", "512", "--rates", "inf,2"])
    assert (a.output_len_min, a.output_len_max, a.rate_list) == (32, 512, [math.inf, 2.0])
    assert bvp.parse_args(["--request-rate", "3"]).rate_list == [3.0]
    with pytest.raises(ValueError, match="not both"):
        bvp.parse_args(["--rates", "inf", "--request-rate", "1"])
    with pytest.raises(ValueError, match="output-len-min"):
        bvp.parse_args(["--output-len-min", "9", "--output-len-max", "8"])
    smoke = bvp.parse_args(["--smoke"])
    assert smoke.rate_list == [math.inf, 4.0] and smoke.ttft_at_saturation_frac == 0.8
    assert smoke.hf_static_max_requests == 2 and smoke.output_len_min < smoke.output_len_max


def test_marked_section_is_appended_to_a_file_without_markers(tmp_path):
    doc = tmp_path / "BENCH.md"
    doc.write_text("# Benchmarks\n\n<!-- a:start -->\nA\n<!-- a:end -->\n")
    bench_common.replace_marked_section(doc, "<!-- b:start -->", "<!-- b:end -->", "B", header="# unused")
    assert doc.read_text() == "# Benchmarks\n\n<!-- a:start -->\nA\n<!-- a:end -->\n\n<!-- b:start -->\nB\n<!-- b:end -->\n"


# ----------------------------------------------------------------------------- bench_prefix_cache

def test_prefix_cache_summary_ratios_and_schedule():
    import bench_prefix_cache as bpc

    s = bpc.summarize_ttft([0.1, 0.2, 0.3, 0.4, 0.5], [0.01, 0.02, 0.05])
    assert s["uncached"] == {"n": 5, "median_ms": pytest.approx(300.0), "p90_ms": pytest.approx(460.0)}  # pos 3.6
    assert s["cached"]["median_ms"] == pytest.approx(20.0) and s["cached"]["p90_ms"] == pytest.approx(44.0)  # pos 1.8
    assert s["ratio_median"] == pytest.approx(15.0) and s["ratio_p90"] == pytest.approx(460 / 44)
    assert bpc.schedule(3) == [(0, "uncached"), (0, "cached"), (1, "cached"), (1, "uncached"),
                               (2, "uncached"), (2, "cached")]
    qs = bpc.questions(20)
    assert len(set(qs)) == 20
    S = bpc.Sample
    samples = [S("uncached", 0, 0.3, 0, 1010, True), S("cached", 0, 0.03, 1008, 1010, True),
               S("uncached", 1, 0.5, 0, 1012, True), S("cached", 1, math.nan, None, None, False, "HTTP 500: x")]
    r = bpc.report(samples)
    assert (r["uncached"]["n"], r["cached"]["n"], r["cached"]["failed"]) == (2, 1, 1)
    assert r["ratio_median"] == pytest.approx(400 / 30) and r["cached"]["cached_tokens_median"] == 1008
    meta = {"date": "d", "model": "m", "model_desc": "x", "workload": "w", "machine": {"cpu": "c"}, "command": "c"}
    md = bpc.markdown_report(r, meta)
    assert "| cached (shared cache_salt) | 1 | 30.0 | 30.0 | 1008 | 1 |" in md
    assert "TTFT uncached / cached: 13.33x at the median" in md and "HTTP 500: x" in md


def test_prefix_cache_system_prompt_has_the_asked_length(tokenizer_dir):
    import bench_prefix_cache as bpc

    tok = bs.load_tokenizer(tokenizer_dir)
    text, n = bpc.system_prompt(tok, 150)
    assert n == len(tok.encode(text, add_special_tokens=False)) and abs(n - 150) <= 2


def test_prefix_cache_smoke_run(tmp_path):
    """The whole script against a real `jaxserve serve` (tiny preset, 4 questions)."""
    import subprocess

    import os

    out = tmp_path / "pc.json"
    # The server needs one device, not the 8 fake ones conftest asks for (fewer threads, faster start).
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_prefix_cache.py"), "--smoke", "--json-out", str(out),
                           "--log-dir", str(tmp_path / "logs")], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["uncached"]["n"] == summary["cached"]["n"] == 4
    assert summary["uncached"]["cached_tokens_median"] == 0        # a fresh salt never hits
    assert summary["cached"]["cached_tokens_median"] >= 128        # the 200-token system prompt, whole pages
    assert "TTFT uncached / cached" in proc.stdout


# ----------------------------------------------------------------------------- bench_vs_peers: llama-server peer
# None of these needs the llama-server binary, llama.cpp's converter or the network: a missing
# install is the skip path, and the converter is replaced by a stand-in script.

FAKE_CONVERTER = '''
import sys
from pathlib import Path
model_dir, outtype, out = sys.argv[1], sys.argv[sys.argv.index("--outtype") + 1], sys.argv[sys.argv.index("--outfile") + 1]
assert out.endswith(".gguf"), out
Path(out).write_text(f"GGUF {outtype} of {model_dir}")
calls = Path(sys.argv[0]).with_name("calls")
calls.write_text(calls.read_text() + "x" if calls.exists() else "x")
'''


def _fake_llama_cpp(home: Path) -> Path:
    """An install layout like setup_llama_cpp.sh's, with a stand-in converter and an inert 'binary'."""
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "llama-server").write_text("#!/bin/sh\nexit 1\n")
    (home / "bin" / "llama-server").chmod(0o755)
    (home / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    (home / "VERSION").write_text("llama-cpp-python==0.0.test\n")
    return home


def _fake_model_dir(root: Path) -> Path:
    model = root / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    (model / "model.safetensors").write_bytes(b"\x00" * 64)
    (model / ".complete").write_text("ok\n")
    return model


def test_llama_server_command_line():
    import bench_vs_peers as bvp

    assert bvp.llama_slot_context(500, 128) == 500 + 128 + bvp.LLAMA_CTX_SLACK
    cmd = bvp.llama_server_command(Path("/opt/llama/bin/llama-server"), Path("/m/model.f32.gguf"), 8123,
                                   n_parallel=64, slot_context=692, threads=2, extra_args="--metrics -ub 256")
    assert cmd[0] == "/opt/llama/bin/llama-server"

    def flag(name):
        return cmd[cmd.index(name) + 1]

    assert flag("-m") == "/m/model.f32.gguf" and flag("--host") == "127.0.0.1" and flag("--port") == "8123"
    assert flag("-np") == "64" and flag("-c") == str(64 * 692) and flag("-t") == "2"  # -c: total over the slots
    assert "--cont-batching" in cmd and flag("-ctk") == flag("-ctv") == "f32" and flag("--cache-ram") == "0"
    assert cmd[-3:] == ["--metrics", "-ub", "256"]  # the user's flags come last and win
    with pytest.raises(ValueError, match="n_parallel"):
        bvp.llama_server_command(Path("s"), Path("g"), 1, n_parallel=0, slot_context=10, threads=1)


def test_llama_server_slots_follow_the_concurrency(tmp_path, monkeypatch):
    """One slot per request in flight: --max-concurrency, else the whole burst, capped at llama.cpp's
    most sequences; context per slot from the longest prompt and output; the GGUF comes from the
    (stand-in) converter."""
    import contextlib

    import bench_vs_peers as bvp

    home, model = _fake_llama_cpp(tmp_path / "llama"), _fake_model_dir(tmp_path)
    monkeypatch.setattr(bvp, "usable_cores", lambda: 3)
    prompts = [bs.PromptSpec("p", 5, 3)] * 10
    base = bs.BenchConfig(base_url="", model=str(model))
    monkeypatch.setattr(bvp, "LLAMA_MAX_SLOTS", 8)
    for extra, slots in (([], 8), (["--max-concurrency", "4"], 4), (["--max-concurrency", "9"], 8)):
        a = bvp.parse_args(["--systems", "llama-server", "--llama-cpp-home", str(home), "--prompt-len-max", "300",
                            "--output-len-max", "100", "--output-len-min", "1", "--log-dir", str(tmp_path / "logs"),
                            *extra])
        with contextlib.ExitStack() as stack:
            s = bvp.llama_server_system(a, stack, model, base, prompts, None)
        assert s.error is None and s.serving and not s.is_jaxserve
        cmd = s.measure.cmd  # the ServerSystem was built, not started
        assert cmd[cmd.index("-np") + 1] == str(slots) and cmd[cmd.index("-t") + 1] == "3"
        assert cmd[cmd.index("-c") + 1] == str(slots * (300 + 100 + bvp.LLAMA_CTX_SLACK))
        assert cmd[cmd.index("-m") + 1].endswith(".f32.gguf") and s.measure.exact_lengths
        notes = bvp.system_notes(a, "llama-cpp-python==0.0.test")
        assert any(n.startswith("llama-server:") and f"-np {slots}" in n and "0.0.test" in n for n in notes)
    assert (home / "calls").read_text() == "x"  # converted once for both


def test_llama_server_is_skipped_with_one_message_when_not_built(tmp_path, capsys):
    import contextlib

    import bench_vs_peers as bvp

    assert "llama-server" in bvp.parse_args([]).systems.split(",")  # a default peer
    a = bvp.parse_args(["--systems", "llama-server", "--llama-cpp-home", str(tmp_path / "none")])
    assert bvp.LlamaCpp(tmp_path / "none").missing() is not None
    with contextlib.ExitStack() as stack:
        s = bvp.llama_server_system(a, stack, tmp_path, bs.BenchConfig(base_url="", model="m"), [], None)
    assert s.serving and "bash scripts/setup_llama_cpp.sh" in s.error and str(tmp_path / "none") in s.error
    out = capsys.readouterr().out
    assert out.count("setup_llama_cpp.sh") == 1 and out.startswith("llama-server: skipped")
    with pytest.raises(RuntimeError, match="setup_llama_cpp.sh"):
        s.measure(math.inf)
    # The run's loop skips it (s.error) and the report names the reason.
    rows = bvp.summarize_systems([s])
    meta = {"date": "d", "model": "m", "model_desc": "x", "workload": "w", "repeats": 1, "machine": {"cpu": "c"},
            "command": "c"}
    assert f"not measured: {bvp.LLAMA_SERVER_LABEL} — llama-server not found" in bvp.markdown_report(rows, meta)
    # A binary without the converter is not an install either.
    home = _fake_llama_cpp(tmp_path / "partial")
    (home / "convert_hf_to_gguf.py").unlink()
    assert "--force" in bvp.LlamaCpp(home).missing()
    assert bvp.LlamaCpp(_fake_llama_cpp(tmp_path / "whole")).missing() is None


def test_llama_server_request_body_forces_the_drawn_length():
    import bench_vs_peers as bvp

    base = bs.BenchConfig(base_url="", model="m", prompt_as="text", extra_body={"top_k": 1})
    cfg = bvp.llama_server_config(base, 8123)
    assert cfg.base_url == "http://127.0.0.1:8123" and base.extra_body == {"top_k": 1}  # base untouched
    body = bs.request_body(cfg, bs.PromptSpec("some text", 3, 17))
    assert body["prompt"] == "some text" and body["stream"] is True
    assert body["max_tokens"] == 17 and "n_predict" not in body  # llama-server reads max_tokens as n_predict
    assert body["ignore_eos"] is True and body["cache_prompt"] is False and body["top_k"] == 1
    assert body["stream_options"] == {"include_usage": True} and "generation_config" not in body


def test_length_problems_count_usage_tokens_and_cache_hits():
    import bench_vs_peers as bvp

    def req(asked, got, cached=0, ok=True):
        return {"ok": ok, "output_len_requested": asked, "output_tokens": got, "cached_tokens_reported": cached}

    assert bvp.length_problems({"requests": [req(5, 5), req(7, 7, None), req(9, 0, ok=False)]}) is None
    problem = bvp.length_problems({"requests": [req(5, 5), req(7, 3), req(9, 2)]})
    assert problem.startswith("2 of 3 requests did not generate") and "asked 7, got 3" in problem
    assert "reused cached prompt tokens (e.g. 32)" in bvp.length_problems({"requests": [req(5, 5, 32)]})


def test_gguf_is_cached_next_to_the_model_by_its_files(tmp_path):
    import bench_vs_peers as bvp

    home, model = _fake_llama_cpp(tmp_path / "llama"), _fake_model_dir(tmp_path)
    key = bvp.gguf_cache_key(model, "v1")
    assert key == bvp.gguf_cache_key(model, "v1") and len(key) == 16
    assert key != bvp.gguf_cache_key(model, "v2") and key != bvp.gguf_cache_key(model, "v1", outtype="f16")
    (model / ".complete").write_text("a marker is not the model\n")
    assert bvp.gguf_cache_key(model, "v1") == key
    assert bvp.gguf_path(model, key) == model.parent / f"m.{key}.f32.gguf"  # next to the dir

    llama = bvp.LlamaCpp(home)
    log = tmp_path / "logs" / "convert.log"
    first = bvp.ensure_gguf(model, llama, log)
    assert first == bvp.gguf_path(model, bvp.gguf_cache_key(model, llama.version))
    assert first.read_text() == f"GGUF f32 of {model}" and (home / "calls").read_text() == "x"
    assert bvp.ensure_gguf(model, llama, log) == first and (home / "calls").read_text() == "x"  # cached
    other = model.parent / f"m.v2.{key}.f32.gguf"  # another model's cache ("m.v2") is not ours to remove
    other.write_text("keep")
    (model / "model.safetensors").write_bytes(b"\x01" * 64)  # same names and sizes, new weights
    second = bvp.ensure_gguf(model, llama, log)
    assert second != first and second.is_file() and not first.exists()  # reconverted; stale one removed
    assert other.read_text() == "keep"
    assert (home / "calls").read_text() == "xx"
    assert not list(model.parent.glob(".*.tmp.gguf"))


def test_gguf_conversion_failure_is_reported_with_the_log(tmp_path):
    import bench_vs_peers as bvp

    home, model = _fake_llama_cpp(tmp_path / "llama"), _fake_model_dir(tmp_path)
    (home / "convert_hf_to_gguf.py").write_text("import sys\nprint('no Qwen3 here')\nsys.exit(3)\n")
    with pytest.raises(RuntimeError, match="exited with 3") as err:
        bvp.ensure_gguf(model, bvp.LlamaCpp(home), tmp_path / "convert.log")
    assert "no Qwen3 here" in str(err.value) and not list(model.parent.glob("*.gguf"))


def test_jaxserve_runs_with_its_defaults_and_workloads_are_named():
    import bench_vs_peers as bvp

    cmd = bvp.jaxserve_command(Path("/m"), 8000)
    assert cmd[cmd.index("--port") + 1] == "8000" and cmd[cmd.index("--dtype") + 1] == "float32"
    assert not {"--max-num-seqs", "--max-num-batched-tokens", "--token-buckets", "--seq-buckets",
                "--kv-cache-memory", "--max-model-len"} & set(cmd)
    cmd = bvp.jaxserve_command(Path("/m"), 8000, 8, None, "--token-buckets 64")
    assert cmd[-4:] == ["--max-num-seqs", "8", "--token-buckets", "64"]
    for argv in ([], ["--smoke"], ["--workload", "bench-small-burst64"]):
        a = bvp.parse_args(argv)
        assert a.jaxserve_args is None and a.max_num_seqs is None and a.max_num_batched_tokens is None
        assert "with its default settings (no tuning flags)" in bvp.system_notes(a)[0]

    a = bvp.parse_args(["--workload", "bench-small-burst64"])
    assert (a.model_preset, a.num_requests, a.prompt_len_min, a.prompt_len_max, a.output_len_min,
            a.output_len_max, a.rate_list, a.docs_section) == ("bench-small", 64, 30, 500, 16, 128, [math.inf],
                                                                "bench-small-burst64")
    a = bvp.parse_args(["--workload", "bench-105m-burst128"])
    assert (a.model_preset, a.num_requests, a.prompt_len_min, a.prompt_len_max, a.output_len_min,
            a.output_len_max) == ("bench-105m", 128, 64, 1024, 32, 256)
    a = bvp.parse_args(["--workload", "bench-105m-burst128", "--num-requests", "16", "--output-len", "8",
                        "--docs-section", "x", "--model", "/d"])
    assert (a.num_requests, a.output_len_min, a.output_len_max, a.docs_section, a.model, a.model_preset) == (
        16, 8, 8, "x", "/d", None)
    a = bvp.parse_args([])
    assert (a.num_requests, a.prompt_len_min, a.prompt_len_max, a.output_len_min, a.docs_section) == (32, 32, 256, 64, None)
    with pytest.raises(ValueError, match="not both"):
        bvp.parse_args(["--smoke", "--workload", "bench-small-burst64"])
    with pytest.raises(ValueError, match="llama-server"):
        bvp.parse_args(["--systems", "vllm"])


def test_bench_bursts_configs_and_report():
    import bench_bursts

    assert bench_bursts.parse_config("defaults=") == ("defaults", "")
    assert bench_bursts.parse_config("old = --max-num-seqs 16 --x=1") == ("old", "--max-num-seqs 16 --x=1")
    with pytest.raises(Exception, match="NAME=FLAGS"):
        bench_bursts.parse_config("--max-num-seqs 16")
    rows = [{"config": "defaults", "burst": 64, "tok_s": 700.04, "ttft_p50": 600.4, "ttft_p99": 1200.6,
             "tpot_p50": 50.04, "e2e_p99": 9000.2, "failed": 0}]
    meta = {"model": "bench-small", "prompts": "30-500", "outputs": "16-128", "repeats": 2,
            "configs": [("defaults", "")], "machine": "cpu X", "command": "python scripts/bench_bursts.py"}
    text = bench_bursts.markdown(rows, meta)
    assert "| defaults | 64 | 700.0 | 600 | 1201 | 50.0 | 9000 | 0 |" in text
    assert "defaults: `(none)`" in text and "medians of 2 interleaved repeats" in text
