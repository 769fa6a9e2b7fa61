"""docs/DEPLOY.md stays true: every YAML manifest parses, and every `jaxserve` command line in it (in
shell blocks and in the manifests' container commands) is accepted by the real argument parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from jaxserve.entrypoints.cli import build_parser

DOC = Path(__file__).resolve().parents[1] / "docs" / "DEPLOY.md"
# Kubernetes substitutes $(VAR) from the pod's environment; these stand in for it.
K8S_VARS = {"LWS_LEADER_ADDRESS": "10.0.0.2", "LWS_WORKER_INDEX": "1"}


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


def _manifests() -> list[dict]:
    return [doc for block in _blocks("yaml") for doc in yaml.safe_load_all(block) if doc]


def _containers(node) -> list[dict]:
    """Every container spec anywhere in a manifest."""
    if isinstance(node, dict):
        found = list(node["containers"]) if isinstance(node.get("containers"), list) else []
        return found + [c for v in node.values() for c in _containers(v)]
    if isinstance(node, list):
        return [c for v in node for c in _containers(v)]
    return []


def _container_argv(container: dict) -> list[str]:
    command = container.get("command", [])
    if command[:2] == ["sh", "-c"]:
        text = re.sub(r"\$\((\w+)\)", lambda m: K8S_VARS[m.group(1)], container["args"][0])
        return shlex.split(text)
    return list(command) + list(container.get("args", []))


def _shell_commands() -> list[list[str]]:
    out = []
    for block in _blocks("bash"):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("jaxserve "):
                out.append(shlex.split(line))
    return out


def _commands() -> list[list[str]]:
    from_manifests = [_container_argv(c) for m in _manifests() for c in _containers(m)]
    return _shell_commands() + [argv for argv in from_manifests if argv[:1] == ["jaxserve"]]


def test_the_deploy_guide_has_its_manifests():
    kinds = [m["kind"] for m in _manifests()]
    assert {"LeaderWorkerSet", "Deployment", "Service", "InferencePool"} <= set(kinds), kinds
    lws = next(m for m in _manifests() if m["kind"] == "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = (_container_argv(_containers(template[t])[0]) for t in ("leaderTemplate", "workerTemplate"))
    parser = build_parser()
    ranks = [parser.parse_args(argv[1:]) for argv in (leader, worker)]
    assert [a.host_rank for a in ranks] == [0, 1]
    assert {a.num_hosts for a in ranks} == {template["size"]}
    assert ranks[0].coordinator == ranks[1].coordinator == "10.0.0.2:8476"


@pytest.mark.parametrize("argv", _commands(), ids=lambda argv: " ".join(argv[1:4]))
def test_every_command_in_the_deploy_guide_parses(argv):
    args = build_parser().parse_args(argv[1:])  # argparse exits (SystemExit) on an unknown flag
    assert args.command in ("serve", "router", "proxy")
