"""Every code block of README.md runs as written, in the README's order, and does what the text
around it says: the set-up command starts a real `jaxserve serve` (on port 8000, or on a free port
substituted everywhere when 8000 is taken), the curl and `openai` blocks talk to it, the command
lines run, the offline `LLM()` block runs in a process of its own, the planner's commands print
the README's table rows (tests/test_readme_plan.py: minutes of compiling, in a file of its own so
that --dist loadfile runs it beside this one), and the test command is exactly CI's.

`pip` is a stand-in on PATH that checks the requirements of what the block installs are already
satisfied (packaging's matching, as pip's resolver would) instead of installing: the real install
would rebuild the environment the suite runs in. Every block is claimed by exactly one runner."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from own_process import REPO, child_env

README = Path(REPO) / "README.md"
SERVE_TIMEOUT = 600  # a cold start on CI compiles the first programs with the rest of the suite running


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # where the block starts in README.md

    @property
    def kind(self) -> str | None:
        """The runner that claims it (None: an unlabelled diagram, not code)."""
        claims = [name for name, claims_it in RUNNERS.items() if claims_it(self)]
        assert len(claims) <= 1, f"README.md:{self.line} is claimed by {claims}"
        return claims[0] if claims else None


def _bash_starts(prefix: str):
    return lambda b: b.lang == "bash" and b.text.startswith(prefix)


RUNNERS = {
    "serve": _bash_starts("pip install -e . && jaxserve serve"),
    "suite": _bash_starts("pip install -e '.[test]'"),
    "hub": _bash_starts("pip install huggingface_hub && hf download"),
    "plan": _bash_starts("pip install -e '.[tpu,gpu]'"),
    "commands": _bash_starts("jaxserve serve "),
    "curl": _bash_starts("curl "),
    "llm": lambda b: b.lang == "python" and "LLM()" in b.text,
    "client": lambda b: b.lang == "python" and "LLM()" not in b.text,
}


def readme_blocks() -> list[Block]:
    text = README.read_text()
    return [Block(m[1], m[2], text[:m.start()].count("\n") + 1)
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def _of_kind(*kinds: str) -> list[Block]:
    return [b for b in readme_blocks() if b.kind in kinds]


def test_every_code_block_is_run_by_exactly_one_runner():
    blocks = readme_blocks()
    unclaimed = [b for b in blocks if b.kind is None]
    # the one unlabelled block is the architecture diagram, not something to run
    assert [(b.lang, "─▶" in b.text) for b in unclaimed] == [("", True)], unclaimed
    assert {b.kind for b in blocks} - {None} == set(RUNNERS)  # every runner has a block to run


def test_the_test_command_is_what_ci_runs(bin_dir):
    (block,) = _of_kind("suite")
    ci = (Path(REPO) / ".ci" / "run").read_text().strip().splitlines()
    assert block.text.strip() == ci[-1]
    # the install's requirements are met (the stand-in pip: a real one reinstalled the package, 13 s)
    _run_bash(block.text.split("&&")[0], Path(REPO), _env(bin_dir))


# --- the stand-in pip ---------------------------------------------------------------------------

_PIP = '''#!{python}
"""pip install, checking instead of installing (tests/test_readme.py)."""
import sys, tomllib
from importlib.metadata import PackageNotFoundError, distribution
from packaging.requirements import Requirement

PYPROJECT = tomllib.load(open({pyproject!r}, "rb"))["project"]


def check(req, seen=()):
    if req.marker is not None and not req.marker.evaluate({{"extra": ""}}):
        return
    if req.name == "jaxserve":  # this project: its dependencies and the extras asked for
        for extra in ("", *sorted(req.extras)):
            for line in PYPROJECT["optional-dependencies"][extra] if extra else PYPROJECT["dependencies"]:
                check(Requirement(line), seen)
        return
    try:
        dist = distribution(req.name)
    except PackageNotFoundError:
        sys.exit(f"pip stand-in: {{req}} is not installed")
    if not req.specifier.contains(dist.version, prereleases=True):
        sys.exit(f"pip stand-in: {{req}} is not satisfied by {{req.name}} {{dist.version}}")
    for extra in sorted(req.extras - set(seen)):
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is not None and "extra" in str(sub.marker) and sub.marker.evaluate({{"extra": extra}}):
                sub.marker = None
                check(sub, (*seen, extra))
    print(f"Requirement already satisfied: {{req}} ({{dist.version}})")


args = sys.argv[1:]
assert args[:1] == ["install"], f"pip stand-in handles 'pip install' only, not {{args}}"
targets = [a for a in args[1:] if a != "-e"]
for target in targets:
    check(Requirement("jaxserve" + target[1:]) if target.startswith(".") else Requirement(target))
'''


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("bin")
    pip = directory / "pip"
    pip.write_text(_PIP.format(python=sys.executable, pyproject=str(Path(REPO) / "pyproject.toml")))
    pip.chmod(0o755)
    return directory


def _env(bin_dir: Path | None = None, **overrides: str) -> dict[str, str]:
    env = child_env(**overrides)
    if bin_dir is not None:
        env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


def _run_bash(text: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    done = subprocess.run(["bash", "-c", text], cwd=cwd, env=env or _env(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{text}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


# --- the server and the blocks that talk to it ----------------------------------------------------

def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _at(text: str, port: int) -> str:
    """The README's text with `port` for 8000 (the same text when 8000 is free)."""
    if port == 8000:
        return text
    text = text.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    return re.sub(r"\bjaxserve serve\b", f"jaxserve serve --port {port}", text)


@contextlib.contextmanager
def _serving(command: str, env: dict[str, str], cwd: Path, log: Path, port: int) -> Iterator[subprocess.Popen]:
    """`command` (a README line that starts a server) in its own process group until it answers
    /health 200; stopped with Ctrl-C (SIGINT to the group) on the way out, which must exit 0."""
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + SERVE_TIMEOUT
        while True:
            assert proc.poll() is None, f"{command} exited {proc.returncode}:\n{log.read_text()}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"{command} not ready:\n{log.read_text()}"
            time.sleep(0.2)
        yield proc
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log.read_text()
        # Ctrl-C while programs still compile in the background: a quiet stop, no error or traceback
        assert not re.search(r" ERROR |Traceback", log.read_text()), log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _json_values(text: str) -> list:
    """Every JSON value printed one after another (curl prints responses without separators)."""
    decoder, values, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        value, i = decoder.raw_decode(text, i)
        values.append(value)
        i = len(text) - len(text[i:].lstrip())
    return values


def _check_curl(block: Block, stdout: str) -> None:
    if " -N " in block.text:  # a stream: SSE events of chunks, then [DONE]
        events = [line[len("data: "):] for line in stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and events[:-1], stdout
        assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])
    else:
        replies = _json_values(stdout)
        assert len(replies) == block.text.count("curl ") and all(r["choices"] for r in replies), stdout


def _exec(block: Block, namespace: dict, port: int) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_at(block.text, port), f"README.md:{block.line}", "exec"), namespace)
    return out.getvalue()


def _check_client(block: Block, namespace: dict, port: int, printed: str) -> None:
    reply = namespace.get("reply")
    if "response_format" in block.text:
        # the README says it parses whatever the weights: four samples of the random model
        for sample in range(4):
            printed = _exec(block, namespace, port) if sample else printed
            person = json.loads(printed)
            assert set(person) == {"name", "age"} and isinstance(person["name"], str), person
            assert len(person["name"]) <= 8 and isinstance(person["age"], int) and 0 <= person["age"] <= 150
            assert namespace["reply"].choices[0].finish_reason == "stop"
    elif "stream=True" in block.text:  # read to the end: the last chunk is the usage chunk
        last = namespace["chunk"]
        assert not last.choices and last.usage.completion_tokens > 0, last
    else:
        assert reply.choices and reply.usage.completion_tokens > 0, reply
        assert printed.startswith(str(reply.choices[0].message.content if hasattr(reply.choices[0], "message")
                                      else reply.choices[0].text))


def _commands(block: Block) -> list[str]:
    return [line for line in block.text.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_readme_against_a_real_server(bin_dir, tmp_path):
    port = 8000 if _port_free(8000) else _free_port()
    (serve,) = _of_kind("serve")
    talking = _of_kind("curl", "client", "commands")
    assert min(b.line for b in talking) > serve.line
    env = _env(bin_dir, KEY="readme-key")
    later: list[str] = []
    with _serving(_at(serve.text, port), env, Path(REPO), tmp_path / "serve.log", port):
        namespace: dict = {}
        for block in talking:
            if block.kind == "curl":
                _check_curl(block, _run_bash(_at(block.text, port), tmp_path, env))
            elif block.kind == "client":
                _check_client(block, namespace, port, _exec(block, namespace, port))
            else:
                later += _run_commands(block, serve, env, port, tmp_path)
    assert later, "the --api-key line runs after the first server stopped (it takes the same port)"
    for line in later:
        _serve_with_api_key(line, env, port, tmp_path)


def _run_commands(block: Block, serve: Block, env: dict[str, str], port: int, cwd: Path) -> list[str]:
    """The Serving section's command lines while the first server runs; returns those that start
    another server (run once it has stopped)."""
    later = []
    for line in _commands(block):
        command = line.split("#", 1)[0].strip()
        if command == "jaxserve serve":
            assert serve.text.strip().endswith(command)  # the one already running
        elif command.startswith("jaxserve serve "):
            later.append(command)
        elif command.startswith("jaxserve generate"):
            assert _run_bash(command, cwd, env).strip()
        elif command.startswith("jaxserve convert"):
            src, dst = shlex.split(command)[2:4]
            (cwd / src).symlink_to(_default_model_dir())
            _run_bash(command, cwd, env)
            assert any((cwd / dst).iterdir())
        elif command.startswith("jaxserve bench"):
            out = _run_bash(_at(command, port), cwd, env)
            requests = re.search(r"--num-requests (\d+)", command)[1]
            assert re.search(rf"^requests completed / failed\s+{requests} / 0$", out, re.M), out
        else:
            raise AssertionError(f"README.md:{block.line}: no runner for {command!r}")
    return later


def _serve_with_api_key(command: str, env: dict[str, str], port: int, tmp_path: Path) -> None:
    """`jaxserve serve --model ~/models/Qwen3-0.6B --api-key "$KEY" ...`: ~ is a home holding the
    default model's directory under that name (caches stay where they were); without the key a
    request is refused with 401, with it served."""
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "Qwen3-0.6B").symlink_to(_default_model_dir())
    caches = dict(XDG_CACHE_HOME=os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache"),
                  JAXSERVE_CACHE=os.environ.get("JAXSERVE_CACHE") or str(Path.home() / ".cache" / "jaxserve"))
    with _serving(_at(command, port), {**env, "HOME": str(home), **caches}, tmp_path, tmp_path / "key.log", port):
        url = f"http://127.0.0.1:{port}/v1/models"
        assert httpx.get(url).status_code == 401
        models = httpx.get(url, headers={"Authorization": f"Bearer {env['KEY']}"})
        assert models.status_code == 200 and models.json()["data"], models.text


def _default_model_dir() -> Path:
    from jaxserve.default_model import ensure_default_model

    return ensure_default_model()


# --- the blocks that need no server ---------------------------------------------------------------

def test_the_hub_download_line_finds_a_cached_model_that_serve_then_loads(bin_dir, tmp_path):
    """`hf download` against a Hugging Face cache that holds the model (no network here: offline,
    the command answers from the cache), then the hub id resolves to that snapshot for `serve`."""
    (block,) = _of_kind("hub")
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in _default_model_dir().iterdir():
        (snapshot / f.name).symlink_to(f)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    env = _env(bin_dir, HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    assert str(snapshot) in _run_bash(block.text, tmp_path, env)
    hub_id = re.search(r"jaxserve serve (\S+)", block.text)[1]
    code = f"from checkpoints import resolve_model_dir; print(resolve_model_dir({hub_id!r}))"
    assert _run_bash(f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}", tmp_path, env).strip() == str(snapshot)


def test_the_offline_generation_block_runs_in_a_fresh_process(tmp_path):
    (block,) = _of_kind("llm")
    done = subprocess.run([sys.executable, "-c", block.text], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=SERVE_TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), done.stderr
