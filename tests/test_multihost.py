"""Multi-host serving on one machine: two `jaxserve serve` processes of 4 CPU devices each (gloo
collectives) run one TP=8 model; rank 0 serves HTTP. Its outputs equal one process with 8 devices,
and a rank that dies or stalls makes the others exit non-zero within 30 s, naming the rank."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from jaxserve.distributed.multihost import DEFAULT_STALL_TIMEOUT, MultiHost
from jaxserve.distributed.replicas import replica_env

REPO = Path(__file__).resolve().parents[1]
SIZES = ["--tensor-parallel-size", "8", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
         "--max-model-len", "128", "--num-kv-pages", "48"]
PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3, 4,", "Once upon a time, in a land far away"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """Two serve processes; rank 0 answers HTTP on `port`."""

    def __init__(self, tmp: Path) -> None:
        coordinator = f"127.0.0.1:{_free_port()}"
        self.port = _free_port()
        env = replica_env("cpu", 0, 4, {**os.environ, "HF_HUB_OFFLINE": "1"})  # the suite's XLA flags, 4 devices
        self.logs = [tmp / f"rank{r}.log" for r in (0, 1)]
        self.procs = []
        for rank in (1, 0):
            cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--num-hosts", "2", "--host-rank", str(rank),
                   "--coordinator", coordinator, "--no-progress",
                   "--port", str(self.port), *SIZES]
            with open(self.logs[rank], "w") as log:
                self.procs.insert(0, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self, rank: int) -> str:
        return "\n".join(l for l in self.logs[rank].read_text().splitlines() if not l.startswith("[Gloo]"))

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for rank, p in enumerate(self.procs):
                assert p.poll() is None, f"rank {rank} exited with {p.returncode}:\n{self.log(rank)[-4000:]}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"not ready in {timeout}s:\n{self.log(0)[-3000:]}"
            time.sleep(0.5)

    def exit_within(self, rank: int, seconds: float) -> tuple[int, float]:
        """(exit code, seconds taken) of `rank`, which must exit within `seconds`."""
        t0 = time.monotonic()
        try:
            code = self.procs[rank].wait(seconds)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {rank} still runs {seconds}s after its peer went:\n{self.log(rank)[-3000:]}")
        return code, time.monotonic() - t0

    def __enter__(self) -> "Cluster":
        try:
            self.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _completions(url: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    out = []
    for i, prompt in enumerate(PROMPTS):
        # greedy, and a seeded sample (the sampler's keys come from the request, not the process)
        params = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.9, seed=1234)
        r = client.completions.create(model="jaxserve-tiny", prompt=prompt, max_tokens=16, **params)
        out.append(r.choices[0].text)
    return out


def _one_process_completions() -> list[str]:
    """The same requests on one process with the suite's 8 CPU devices (TP=8)."""
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.core.sampling_params import SamplingParams

    llm = LLM(None, show_progress=False, mesh_shape=(1, 8), max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=128, num_kv_pages=48)
    out = []
    for i, prompt in enumerate(PROMPTS):
        params = (SamplingParams(temperature=0.0, max_tokens=16) if i % 2 == 0
                  else SamplingParams(temperature=0.9, seed=1234, max_tokens=16))
        out.append(llm.generate([prompt], params)[0].outputs[0].text)
    return out


def test_two_processes_serve_one_tp8_model_like_one_process_and_a_dead_follower_stops_the_leader(tmp_path):
    with Cluster(tmp_path) as cluster:
        assert "4 local of 8 devices" in cluster.log(1)
        for rank in (0, 1):  # each host reads its own shards: half of every TP-split tensor
            read, total = map(float, re.search(r"read ([\d.]+) MiB of the ([\d.]+) MiB of unquantized tensors",
                                               cluster.log(rank)).groups())
            assert 0.4 * total < read < 0.6 * total, (rank, read, total)
        served = _completions(cluster.url)
        assert served == _one_process_completions()
        assert all(served), served
        cluster.procs[1].send_signal(signal.SIGKILL)
        code, _ = cluster.exit_within(0, 30)
        assert code != 0
        assert "rank 1 closed its connection" in cluster.log(0)


@pytest.mark.parametrize("victim,sig,message", [
    (0, signal.SIGKILL, "rank 0 (the leader) closed its connection"),
    (1, signal.SIGSTOP, f"rank 1 sent nothing (not even a heartbeat) for {DEFAULT_STALL_TIMEOUT:.0f}s"),  # alive, silent
])
def test_a_dead_or_stalled_rank_stops_the_other(tmp_path, victim, sig, message):
    # the default stall timeout: with 5 s a follower once gave up on a leader that was warming up
    # on a loaded 2-core machine (a suite run, 46 s into warm-up)
    with Cluster(tmp_path) as cluster:
        cluster.procs[victim].send_signal(sig)
        code, seconds = cluster.exit_within(1 - victim, 30)
        # A killed leader also takes JAX's coordination service (it runs in rank 0) with it; the
        # follower's JAX client aborts on losing it (SIGABRT) when that thread notices before our
        # connection watcher does, which a loaded machine makes a race. Either way the follower stops.
        lost_service = victim == 0 and code == -signal.SIGABRT
        assert code != 0 and (message in cluster.log(1 - victim) or lost_service)
        assert seconds >= DEFAULT_STALL_TIMEOUT - 1 or sig == signal.SIGKILL


def test_a_leader_stopped_by_sigterm_stops_its_followers_cleanly(tmp_path):
    """SIGTERM on rank 0 drains, then tells the followers to stop: every rank exits 0."""
    with Cluster(tmp_path) as cluster:
        cluster.procs[0].send_signal(signal.SIGTERM)
        assert cluster.exit_within(0, 30)[0] == 0
        assert cluster.exit_within(1, 30)[0] == 0
        assert "the leader stopped after" in cluster.log(1)


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_hosts=1), "--num-hosts must be >= 2"),
    (dict(num_hosts=2, rank=2), "--host-rank must be in [0, 2)"),
    (dict(num_hosts=2, rank=0, coordinator="nohost"), "--coordinator must be HOST:PORT"),
])
def test_bad_multihost_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        MultiHost(**kwargs)


def test_what_multihost_does_not_mirror_yet_is_refused_by_name():
    from jaxserve.core.config import EngineConfig
    from jaxserve.distributed.multihost import check_supported

    with pytest.raises(ValueError, match="--enable-lora is not supported yet"):
        check_supported(EngineConfig(enable_lora=True))
    with pytest.raises(ValueError, match="'draft_model' is not supported yet"):
        check_supported(EngineConfig(speculative_config={"method": "draft_model", "model": "x",
                                                         "num_speculative_tokens": 2}))
    check_supported(EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pd_roles_on_several_hosts_are_refused_before_anything_starts(role, capsys):
    """The KV export / import / pull programs run on the leader only: a follower would miss them."""
    from jaxserve.core.config import EngineConfig
    from jaxserve.distributed.multihost import check_supported
    from jaxserve.entrypoints import cli

    with pytest.raises(ValueError, match=f"--kv-role {role} .*--num-hosts > 1"):
        check_supported(EngineConfig(kv_role=role))
    code = cli.main(["serve", "--num-hosts", "2", "--host-rank", "0", "--coordinator", "127.0.0.1:1",
                     "--kv-role", role, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "--kv-role" in err and "--num-hosts" in err and "Traceback" not in err


def test_a_step_message_is_pickled_once_for_every_follower(monkeypatch):
    """The leader pickles a step message once and sends the same bytes to each follower (outside
    the lock the heartbeat shares); a follower's recv() reads the message back."""
    import threading
    from multiprocessing import Pipe

    from jaxserve.distributed import multihost

    pickles = []
    real = multihost.ForkingPickler.dumps
    monkeypatch.setattr(multihost.ForkingPickler, "dumps", lambda obj: pickles.append(obj) or real(obj))
    pipes = [Pipe() for _ in range(3)]
    leader = multihost.Followers.__new__(multihost.Followers)
    leader._lock = threading.Lock()
    leader.conns = {rank + 1: a for rank, (a, _) in enumerate(pipes)}
    message = ("forward", {"tokens": list(range(1000))})
    leader.send(message)
    assert len(pickles) == 1
    assert all(b.recv() == message for _, b in pipes)
