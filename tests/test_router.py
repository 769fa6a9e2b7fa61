"""Data-parallel replicas behind the router: `jaxserve serve --data-parallel-size 2` (two engine
processes, one CPU device each) with the official openai client. 100 concurrent streams all
complete and split within 20 % of even; a shared-prefix workload lands on one replica, whose
prefix cache serves it. `serve --disaggregate 1:1` (a prefill and a decode instance behind the PD
proxy, one command) gives the colocated output with the prompt's pages shipped. Neither launcher
leaves a replica running after SIGTERM. Plus the routing policy, the metrics relabelling and the
replica set-up on their own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx
import openai
import pytest

from jaxserve.distributed.router import merge_replica_metrics, routing_key
from jaxserve.distributed.routing_policy import PREFIX_BLOCK_CHARS, RoutingPolicy
from jaxserve.distributed.replicas import (cpu_pool_share, local_platform, replica_argv, replica_env, split_cores,
                                      watch_replicas)

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the policy alone

def test_requests_without_a_shared_prefix_go_to_the_least_loaded_replica_in_turn():
    policy = RoutingPolicy(3)
    chosen = [policy.choose(f"prompt {i}") for i in range(6)]
    assert chosen == [0, 1, 2, 0, 1, 2]
    policy.done(1)
    policy.done(1)
    assert policy.choose("another") == 1


def test_a_request_goes_to_the_replica_holding_its_longest_prefix():
    policy = RoutingPolicy(2)
    system = "You are a helpful assistant. " * 10  # > 4 blocks
    first = policy.choose(system + "Question one")
    other = policy.choose("unrelated " * 20)
    assert other != first
    assert all(policy.choose(system + f"Question {i}") == first for i in range(5))
    assert policy.loads[first].by_prefix == 5
    # the longest remembered prefix decides: replica 1 holds system + extra, replica 0 system alone
    longer = system + "x" * (2 * PREFIX_BLOCK_CHARS)
    policy = RoutingPolicy(2)
    assert policy.choose(longer, healthy=[False, True]) == 1
    assert policy.choose(system, healthy=[True, False]) == 0
    assert policy.choose(system + " and more") == 0
    assert policy.choose(longer + " and more") == 1


def test_load_wins_over_the_prefix_once_the_holder_is_far_busier():
    policy = RoutingPolicy(2, balance_slack=3, balance_ratio=1.5)
    key = "shared prefix " * 20
    holder = policy.choose(key)
    for _ in range(3):
        assert policy.choose(key) == holder  # in flight 2, 3, 4 vs 0: within slack until 4 - 0 > 3
    assert policy.choose(key) == 1 - holder
    assert policy.loads[holder].in_flight == 4


def test_unhealthy_replicas_get_nothing():
    policy = RoutingPolicy(3)
    assert {policy.choose(str(i), healthy=[False, True, False]) for i in range(4)} == {1}
    with pytest.raises(RuntimeError, match="no replica is healthy"):
        policy.choose("x", healthy=[False, False, False])


def test_routing_keys_are_the_prompt_or_the_messages():
    assert routing_key({"prompt": "abc"}) == "abc"
    chat = routing_key({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]})
    assert chat.startswith('[{"role":"system","content":"S"}')


def test_replicas_metrics_merge_into_one_family_per_name_and_any_label_value_survives():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from jaxserve.distributed.router import _Families

    def replica(running: float, adapter: str) -> str:
        return ("# HELP jaxserve:num_requests_running Sequences.\n# TYPE jaxserve:num_requests_running gauge\n"
                f'jaxserve:num_requests_running{{model_name="m"}} {running}\n'
                "# HELP jaxserve:lora_requests_total Requests.\n# TYPE jaxserve:lora_requests_total counter\n"
                f'jaxserve:lora_requests_total{{adapter="{adapter}"}} 2.0\nprocess_cpu 1.5\n')

    tricky = 'sql}{"x"'.replace('"', '\\"')  # a `}` and an escaped quote inside a label value
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(merge_replica_metrics([(0, replica(3, tricky)), (1, replica(5, "plain"))])))
    text = generate_latest(registry).decode()
    assert text.count("# HELP jaxserve:num_requests_running ") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}  # the output parses back
    running = families["jaxserve:num_requests_running"].samples
    assert {(s.labels["replica"], s.labels["model_name"], s.value) for s in running} == {("0", "m", 3.0), ("1", "m", 5.0)}
    lora = families["jaxserve:lora_requests"].samples
    assert {(s.labels["replica"], s.labels["adapter"]) for s in lora} == {("0", 'sql}{"x"'), ("1", "plain")}
    # one family's samples are together: no other family's line between them
    lines = [line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")]
    first = lines.index("jaxserve:num_requests_running")
    assert lines[first:first + 2] == ["jaxserve:num_requests_running"] * 2
    # a replica whose text does not parse is left out, the others stay
    assert [f.name for f in merge_replica_metrics([(0, "not { metrics"), (1, "x 1\n")])] == ["x"]


def test_each_replica_sees_its_own_devices_and_port():
    assert replica_argv(["--model", "m", "--port", "8000", "--data-parallel-size=2", "--host", "0.0.0.0",
                         "--max-num-seqs", "4"], 8002) == ["--model", "m", "--max-num-seqs", "4", "--host",
                                                           "127.0.0.1", "--port", "8002"]
    env = replica_env("cpu", 1, 2, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/d"})
    assert env["XLA_FLAGS"] == "--xla_dump_to=/d --xla_force_host_platform_device_count=2"
    assert replica_env("gpu", 1, 2, {})["CUDA_VISIBLE_DEVICES"] == "2,3"
    tpu = replica_env("tpu", 1, 1, {})
    assert (tpu["TPU_VISIBLE_CHIPS"], tpu["TPU_PROCESS_PORT"]) == ("1", "8477")
    with pytest.raises(ValueError, match="a replica of 3 chips"):
        replica_env("tpu", 0, 3, {})
    assert local_platform({"JAX_PLATFORMS": "cuda"}) == "gpu"


def test_cpu_replicas_get_disjoint_shares_of_the_cores():
    assert split_cores([5, 0, 1, 2, 3], 2) == [[0, 1, 2], [3, 5]]
    assert split_cores([0, 1], 2) == [[0], [1]]
    assert split_cores(range(8), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert split_cores([0], 2) is None  # fewer cores than replicas: they share (a warning says so)


def test_cpu_replicas_size_their_pools_from_a_share_of_the_ram():
    assert cpu_pool_share(["--model", "m"], 2) == ["--memory-utilization", "0.25"]
    assert cpu_pool_share([], 3) == ["--memory-utilization", "0.1667"]
    for sized in (["--kv-cache-memory", "1GiB"], ["--num-kv-pages=64"], ["--memory-utilization", "0.2"]):
        assert cpu_pool_share(sized, 2) == []  # the user's size holds for each replica


# ---------------------------------------------------------------- two real replicas

def _free_port_block(n: int) -> int:
    """A port p with p..p+n-1 free (the router takes p, replica i takes p+1+i), below the kernel's
    ephemeral range: a port in that range can be taken between this check and the replica's bind
    by any outgoing connection (the router's own health polls included)."""
    ephemeral_lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        base = random.randrange(10_000, ephemeral_lo - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


def _metric(text: str, name: str, replica: int) -> float:
    """The sum of `name`'s samples labelled replica="replica" in the router's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and s.labels.get("replica") == str(replica))


def _launch(flags: list[str], out) -> subprocess.Popen:
    """`jaxserve serve FLAGS` at small sizes (7 programs, not the 22 of 16 seqs / 256 tokens / 512
    context: each replica compiles its set on one core, which took ~170 s of the suite per launch)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", *flags, "--max-num-seqs", "4", "--max-num-batched-tokens",
           "64", "--max-model-len", "256", "--no-progress", "--no-access-log"]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def _jaxserve_serve(flags: list[str], log: Path, ready: Callable[[], bool],
                    replica_ports: range) -> Iterator[None]:
    """`jaxserve serve FLAGS` (the tiny default model, small sizes) as a subprocess, yielded once
    `ready()` holds; SIGTERM afterwards, after which no replica may still listen."""
    with open(log, "w") as out:
        proc = _launch(flags, out)
    deadline = time.monotonic() + 300
    try:
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                if ready():
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(1)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(150) == 0, log.read_text()[-4000:]
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        for port in replica_ports:
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", port)) != 0, f"a replica on port {port} outlived its launcher"


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory):
    port = _free_port_block(3)
    log = tmp_path_factory.mktemp("dp") / "serve.log"
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        return all(_metric(text, "jaxserve_router:replica_healthy", i) == 1 for i in (0, 1))

    flags = ["--data-parallel-size", "2", "--port", str(port)]
    with _jaxserve_serve(flags, log, ready, range(port + 1, port + 3)):
        yield url, log


async def _stream(client: openai.AsyncOpenAI, prompt: str, max_tokens: int = 8) -> str | None:
    stream = await client.completions.create(model="jaxserve-tiny", prompt=prompt, max_tokens=max_tokens,
                                             temperature=0.0, stream=True)
    finish = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return finish


def test_100_concurrent_streams_complete_and_split_evenly(data_parallel):
    url, _ = data_parallel
    before = httpx.get(f"{url}/metrics").text

    async def run() -> list[str | None]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=300, max_retries=0)
        return await asyncio.gather(*(_stream(client, f"{i}: tell me about item number {i * 7919}")
                                      for i in range(100)))

    finishes = asyncio.run(run())
    assert all(f in ("length", "stop") for f in finishes), finishes
    after = httpx.get(f"{url}/metrics").text
    routed = [_metric(after, "jaxserve_router:routed_total", i) - _metric(before, "jaxserve_router:routed_total", i)
              for i in (0, 1)]
    served = [_metric(after, "jaxserve:request_success_total", i)
              - _metric(before, "jaxserve:request_success_total", i) for i in (0, 1)]
    assert routed == served and sum(served) == 100, (routed, served)
    assert all(40 <= n <= 60 for n in served), served
    assert all(_metric(after, "jaxserve_router:in_flight", i) == 0 for i in (0, 1))


def test_a_shared_prefix_workload_lands_on_one_replica_and_hits_its_prefix_cache(data_parallel):
    url, _ = data_parallel
    system = "You are a meticulous assistant who answers questions about the jaxserve engine. " * 6
    before = httpx.get(f"{url}/metrics").text

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=300, max_retries=0)
        await _stream(client, system + "First question?")
        for batch in range(4):  # 4 at a time: the holder stays within the balance slack
            await asyncio.gather(*(_stream(client, system + f"Question {batch}.{j}?") for j in range(4)))

    asyncio.run(run())
    after = httpx.get(f"{url}/metrics").text
    delta = lambda name, i: _metric(after, name, i) - _metric(before, name, i)  # noqa: E731
    routed = [delta("jaxserve_router:routed_total", i) for i in (0, 1)]
    holder = routed.index(17)
    assert routed[1 - holder] == 0, routed
    assert delta("jaxserve_router:routed_by_prefix_total", holder) == 16
    assert delta("jaxserve:prefix_cache_hits_total", holder) > 16 * 50  # the shared prompt's pages, reused
    assert delta("jaxserve:prefix_cache_hits_total", 1 - holder) == 0


def test_the_router_passes_errors_through_and_refuses_bad_json(data_parallel):
    url, _ = data_parallel
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not a JSON object" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json={"model": "jaxserve-tiny", "prompt": "hi", "max_tokens": -3})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]  # the replica's own answer
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "jaxserve-tiny"
    # the tokenizer routes and the version: any healthy replica's answer, errors included
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == 2 and tokens["max_model_len"] > 0
    assert httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    assert httpx.get(f"{url}/version").json()["version"]
    r = httpx.post(f"{url}/detokenize", json={"tokens": ["x"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_the_watcher_stops_on_a_replica_error_but_not_on_a_drained_replica():
    """Ctrl-C reaches the replicas too: one that drained (exit 0) or died of SIGINT/SIGTERM before
    the launcher stopped is no failure; one that exits 3 is, and is named."""
    def run(code: str) -> tuple[list[str], list[bool]]:
        procs = [subprocess.Popen([sys.executable, "-c", code])]
        failed, stops, stopping = [], [], threading.Event()
        watcher = threading.Thread(target=watch_replicas, args=(procs, stopping, failed, lambda: stops.append(True)))
        watcher.start()
        procs[0].wait()
        watcher.join(3)  # returns at once on a failure; otherwise still watching
        stopping.set()
        watcher.join()
        return failed, stops

    for drained in ("import sys; sys.exit(0)", "import os, signal; os.kill(os.getpid(), signal.SIGINT)",
                    "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"):
        assert run(drained) == ([], []), drained
    failed, stops = run("import sys; sys.exit(3)")
    assert stops == [True] and re.fullmatch(r"replica 0 \(pid \d+\) exited with 3", failed[0]), failed


def test_a_replica_that_cannot_start_stops_the_launcher_with_exit_1_naming_it(tmp_path):
    """Replica 0's port is taken: the launcher must not go on serving on replica 1 alone (the
    front's /health would answer 200 forever); it stops replica 1 and exits 1 naming replica 0."""
    port = _free_port_block(3)
    log = tmp_path / "serve.log"
    with socket.socket() as taken, open(log, "w") as out:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        proc = _launch(["--data-parallel-size", "2", "--port", str(port)], out)
        try:
            rc = proc.wait(240)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert rc == 1, text[-4000:]
    assert re.search(r"replica 0 \(pid \d+\) exited with [1-9]\d* on its own", text), text[-4000:]
    assert "replica 1 exited with" in text  # stopped and waited for, not left behind
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port + 2)) != 0, "replica 1 outlived its launcher"


# ---------------------------------------------------------------- prefill/decode in one command

def _total(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_disaggregate_starts_prefill_and_decode_instances_behind_the_proxy(tmp_path):
    """`serve --disaggregate 1:1`: the PD proxy on PORT, a prefill instance on PORT+1, a decode
    instance on PORT+2. A greedy completion through the proxy is the decode instance's own
    (colocated) answer, and the prompt's pages went from the one to the other."""
    port = _free_port_block(3)
    url, prefill, decode = (f"http://127.0.0.1:{port + i}" for i in range(3))
    prompt = "Disaggregation ships the pages of a prompt from the prefill instance to the decode one. " * 3
    with _jaxserve_serve(["--disaggregate", "1:1", "--port", str(port)], tmp_path / "serve.log",
                         lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200,
                         range(port + 1, port + 3)):
        def complete(base: str, **extra) -> str:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=300, max_retries=0)
            return client.completions.create(model="jaxserve-tiny", prompt=prompt, max_tokens=12, temperature=0.0,
                                             extra_body=extra).choices[0].text

        # each instance runs on its own share of this process's cores (a CPU replica's compute)
        pids = [int(m) for m in re.findall(r"replica \d+ --kv-role \w+: pid (\d+)", (tmp_path / "serve.log").read_text())]
        shares = split_cores(os.sched_getaffinity(0), 2) or [os.sched_getaffinity(0)] * 2
        assert len(pids) == 2 and [os.sched_getaffinity(pid) for pid in pids] == [set(c) for c in shares]
        assert (tmp_path / "serve.log").read_text().count("0.25 of available RAM") == 2  # half the default each
        through = complete(url)
        exported = _total(httpx.get(f"{prefill}/metrics").text, "jaxserve:kv_exported_pages_total")
        imported = _total(httpx.get(f"{decode}/metrics").text, "jaxserve:kv_imported_pages_total")
        assert exported == imported > 0, (exported, imported)
        assert through == complete(decode, cache_salt="computed here")  # no imported page can serve it
        assert httpx.get(f"{prefill}/health").status_code == 200


def test_disaggregate_refuses_what_it_cannot_combine(capsys):
    from jaxserve.entrypoints.cli import main

    for bad in ("0:1", "1", "a:b"):
        with pytest.raises(SystemExit):
            main(["serve", "--disaggregate", bad])
        assert "--disaggregate" in capsys.readouterr().err
    assert main(["serve", "--disaggregate", "1:1", "--kv-role", "decode"]) == 2
    assert "does not combine with --data-parallel-size, --num-hosts or --kv-role" in capsys.readouterr().err
    assert main(["serve", "--disaggregate", "1:1", "--no-enable-prefix-caching"]) == 2
    assert "--disaggregate needs prefix caching" in capsys.readouterr().err
