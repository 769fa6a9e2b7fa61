"""Everything `jaxserve` needs at run time is a declared dependency, not a test extra that happens
to be installed here.

The test extra (torch, openai, scipy, ...) pulls in packages that the runtime also needs but never
imports directly: transformers imports jinja2 only inside `apply_chat_template`, so a fresh
`pip install jaxserve` served chat with a 400 while this suite passed. Two checks:

- static: every module imported anywhere in the package (inside functions too) comes from the
  standard library, from this project, or from a distribution in the transitive closure of
  pyproject's `[project].dependencies`;
- dynamic: the real server path runs in subprocesses where every installed distribution outside
  that closure cannot be found (as on a fresh install): the embedded model's tokenizer and chat
  template, the app, a forward pass with int4-quantized weights (qwix), one of a mixture of experts,
  tokamax's import (absl), `jaxserve serve` answering
  a chat request and a JSON-schema one (llguidance), and `jaxserve bench` against it.
  Its log must also be free of start-up noise (torch not found, libtpu missing).
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from own_process import child_env

REPO = Path(__file__).resolve().parents[1]
PROJECT = "jaxserve"
PACKAGES = ("jaxserve", "checkpoints", "kernels_pallas")
# A venv brings pip; nothing else is there before `pip install jaxserve`.
VENV_DISTRIBUTIONS = frozenset({"pip"})


# ---------------------------------------------------------------- the runtime closure


def runtime_closure(pyproject: Path = REPO / "pyproject.toml") -> frozenset[str]:
    """Canonical names of the distributions a plain `pip install jaxserve` installs: the declared
    dependencies and, through the installed metadata, theirs (markers honoured, extras followed
    only where a requirement asks for them)."""
    declared = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    pending = [r for r in map(Requirement, declared) if r.marker is None or r.marker.evaluate({"extra": ""})]
    extras_of: dict[str, set[str]] = {}
    while pending:
        req = pending.pop()
        name = canonicalize_name(req.name)
        if name in extras_of and set(req.extras) <= extras_of[name]:
            continue
        extras = extras_of.setdefault(name, set())
        extras.update(req.extras)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # declared for another platform (or not installed here): nothing to follow
        environments = [{"extra": e} for e in ("", *sorted(extras))]
        for text in requires:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate(env) for env in environments):
                pending.append(sub)
    return frozenset(extras_of) | VENV_DISTRIBUTIONS | {PROJECT}


def module_distributions() -> dict[str, set[str]]:
    """Top-level importable name -> canonical names of the installed distributions providing it."""
    return {module: {canonicalize_name(d) for d in dists}
            for module, dists in importlib.metadata.packages_distributions().items()}


def outside_closure(closure: frozenset[str]) -> tuple[list[str], list[str]]:
    """(modules, distributions) installed here but absent on a fresh install: modules whose every
    providing distribution is outside the closure."""
    installed = {canonicalize_name(d.metadata["Name"]) for d in importlib.metadata.distributions()
                 if d.metadata["Name"]}
    missing = installed - closure
    modules = [m for m, dists in module_distributions().items()
               if dists and dists <= missing and m not in sys.stdlib_module_names]
    return sorted(modules), sorted(missing)


# ---------------------------------------------------------------- static: what the package imports


class _Imports(ast.NodeVisitor):
    """Top-level names of absolute imports, anywhere in a module; an import guarded by
    `except ImportError` is optional by construction and skipped."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self._optional = 0

    def visit_Try(self, node: ast.Try) -> None:
        optional = any(_catches_import_error(h) for h in node.handlers)
        self._optional += optional
        for stmt in node.body:
            self.visit(stmt)
        self._optional -= optional
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    def visit_Import(self, node: ast.Import) -> None:
        if not self._optional:
            self.names.update(alias.name.split(".")[0] for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if not self._optional and node.level == 0 and node.module:
            self.names.add(node.module.split(".")[0])


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(t, ast.Name) and t.id in ("ImportError", "ModuleNotFoundError") for t in types)


def package_imports() -> dict[str, list[str]]:
    """Imported top-level module -> the package files importing it."""
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            visitor = _Imports()
            visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
            for name in visitor.names:
                found.setdefault(name, []).append(str(path.relative_to(REPO)))
    return found


def test_every_imported_module_is_stdlib_ours_or_a_declared_dependency():
    closure = runtime_closure()
    providers = module_distributions()
    undeclared = {}
    for module, files in sorted(package_imports().items()):
        if module in sys.stdlib_module_names or module in PACKAGES:
            continue
        dists = providers.get(module, set())
        if not dists & closure:
            undeclared[module] = (sorted(dists) or "not installed", files[:3])
    assert not undeclared, f"imported but not in [project].dependencies (or their dependencies): {undeclared}"


def test_the_closure_follows_markers_and_requested_extras_only(tmp_path):
    """The closure helper itself: a requirement's extras are followed, unrequested ones are not."""
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\ndependencies = ["httpx", "jinja2; python_version < \'3\'"]\n')
    closure = runtime_closure(pyproject)
    assert {"httpx", "httpcore", "anyio"} <= closure  # followed through installed metadata
    assert "jinja2" not in closure                       # its marker is false
    assert "h2" not in closure                           # httpx[http2] was not requested
    declared = runtime_closure()
    assert {"jinja2", "httpx", "transformers", "uvicorn"} <= declared
    assert not {"torch", "pytest", "openai", "hypothesis"} & declared


# ---------------------------------------------------------------- dynamic: run it as a fresh install

# Runs `python gate.py BLOCKED_JSON (MODULE | SCRIPT.py) ARGS...` with every installed distribution
# outside the closure invisible: its modules are not found (find_spec -> None, as when absent, so
# libraries that probe for torch behave as on a fresh install) and its metadata is gone.
GATE = r'''
import json, re, runpy, sys

with open(sys.argv[1]) as f:
    spec = json.load(f)
MODULES, DISTS = frozenset(spec["modules"]), frozenset(spec["distributions"])
refused = set()


def canonical(name):
    return re.sub(r"[-_.]+", "-", name or "").lower()


class Gate:
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in MODULES:
            if top not in refused:
                refused.add(top)
                print(f"[fresh-install gate] {top} is not installed on a fresh install", file=sys.stderr)
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(name, path, target) if find is not None else None

    def find_distributions(self, *args, **kwargs):
        find = getattr(self.inner, "find_distributions", None)
        if find is None:
            return iter(())
        return (d for d in find(*args, **kwargs) if canonical(d.metadata["Name"]) not in DISTS)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


sys.meta_path[:] = [Gate(finder) for finder in sys.meta_path]
target, sys.argv = sys.argv[2], sys.argv[2:]
if target.endswith(".py"):
    runpy.run_path(target, run_name="__main__")
else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
'''

# The client side of a fresh install, run through the gate with the server's URL.
EXERCISE = r'''
import json, sys
from pathlib import Path

from jaxserve.default_model import ensure_default_model
from jaxserve.text.tokenizer import Tokenizer

model_dir = ensure_default_model()
tok = Tokenizer.from_pretrained(model_dir)
ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])  # transformers imports jinja2 here
assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
assert tok.decode(tok.encode("héllo wörld 你好")) == "héllo wörld 你好"

import jaxserve.entrypoints.cli
import jaxserve.server.launch
from jaxserve.server import ServerConfig, build_app

build_app(lambda: None, ServerConfig())  # the loader only runs once the app is served

# Quantized weights (qwix, ml_dtypes): the embedded model's shape, int4 at load, one forward.
import dataclasses
import jax.numpy as jnp
from jaxserve.core.config import ModelConfig
from jaxserve.model.dense import forward_dense
from jaxserve.model.weights import init_random
from jaxserve.quant.scheme import online_scheme

qcfg = dataclasses.replace(ModelConfig.from_hf(model_dir), quantization=online_scheme("int4"))
logits = forward_dense(init_random(qcfg), qcfg, jnp.asarray([[1, 2, 3]]), jnp.ones((1, 3), jnp.int32))
assert logits.shape == (1, 3, qcfg.vocab_size) and bool(jnp.isfinite(logits).all())

# A mixture of experts: a tiny Qwen3-MoE config, one forward.
mcfg = ModelConfig.from_hf({**json.loads((model_dir / "config.json").read_text()),
                            "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 1, "num_experts": 4,
                            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True})
logits = forward_dense(init_random(mcfg), mcfg, jnp.asarray([[1, 2, 3]]), jnp.ones((1, 3), jnp.int32))
assert logits.shape == (1, 3, mcfg.vocab_size) and bool(jnp.isfinite(logits).all())

# tokamax (the TPU/GPU expert kernels) imports, and leaves this process's command line alone
# (its options are absl flags, which would reject `--model`).
saved_argv, sys.argv = sys.argv, [sys.argv[0], "--model", "moe"]
from jaxserve.model.moe import _tokamax
assert _tokamax().config.cross_compile.value is False
sys.argv = saved_argv

report = Path(sys.argv[2])
rc = jaxserve.entrypoints.cli.main(["bench", "--base-url", sys.argv[1], "--model", "jaxserve-tiny", "--endpoint", "chat",
                        "--prompt-as", "text", "--num-requests", "2", "--prompt-len-min", "8",
                        "--prompt-len-max", "8", "--output-len-min", "4", "--output-len-max", "4",
                        "--timeout", "120", "--json-out", str(report)])
assert rc == 0, rc
assert json.loads(report.read_text())["completed"] == 2
print("fresh-install exercise passed")
'''

NOISE = ("PyTorch was not found", "Unable to initialize backend 'tpu'")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gated(tmp_path: Path) -> list[str]:
    """The command prefix that runs a module or script as on a fresh install."""
    modules, dists = outside_closure(runtime_closure())
    assert "torch" in modules, "expected the test extra's torch to be installed (and hidden) here"
    spec = tmp_path / "outside_closure.json"
    spec.write_text(json.dumps({"modules": modules, "distributions": dists}))
    gate = tmp_path / "gate.py"
    gate.write_text(GATE)
    return [sys.executable, str(gate), str(spec)]


@pytest.mark.slow
def test_server_path_runs_with_only_the_declared_dependencies(tmp_path):
    gated = _gated(tmp_path)
    env = child_env()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    # A small step budget: one token bucket, so the real warm-up compiles few programs.
    serve = [*gated, "jaxserve.entrypoints.cli", "serve", "--port", str(port), "--max-model-len", "256", "--max-num-seqs", "4",
             "--max-num-batched-tokens", "16", "--token-buckets", "16", "--num-kv-pages", "64", "--no-progress"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(serve, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "jaxserve-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert chat.status_code == 200, chat.text
        schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
                  "additionalProperties": False}
        structured = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={  # llguidance, no test extra
            "model": "jaxserve-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
        assert structured.status_code == 200, structured.text
        assert json.loads(structured.json()["choices"][0]["message"]["content"])["a"] in ("x", "y")

        exercise = tmp_path / "exercise.py"
        exercise.write_text(EXERCISE)
        client = subprocess.run([*gated, str(exercise), url, str(tmp_path / "bench.json")], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=300)
        assert client.returncode == 0, client.stdout[-3000:] + client.stderr[-6000:]
        assert "fresh-install exercise passed" in client.stdout

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    assert "[fresh-install gate] torch is not installed" in log  # the gate was in force
    assert "Traceback" not in log, log
    for noise in NOISE:
        assert noise not in log, f"start-up noise {noise!r} in the log:\n{log}"
