"""The shape of the house, read from the imports (tests/import_graph.py), so that it cannot drift
back: the rooms (packages) import one way only, in the order docs/ARCHITECTURE.md draws; no module
imports itself in a circle; the model runner's side never imports the scheduler; core and the
scheduler never import jax; few modules at the top; no long module without a reason."""

from __future__ import annotations

import re

import pytest

import import_graph as graph

# Top to bottom: a room imports only rooms below it. Rooms on one line do not import each other.
LAYERS = [
    ("jaxserve",),                      # the package itself (jaxserve/__init__.py)
    ("entrypoints",),                   # cli, LLM
    ("server",),                        # the OpenAI HTTP API
    ("disagg",),                        # PD disaggregation: KV transfer, the PD proxy
    ("distributed", "planning"),        # multi-host, DP router, replicas; plan, targets
    ("engine",),                        # the engine loop, the scheduler, the page allocator, loading
    ("runner",),                        # device state: model runner, programs, step inputs, sampler
    ("lora",),                          # adapters: reading, host slots
    ("checkpoints",),                   # HF / orbax / random weights into device arrays
    ("model",),                         # pure model math over pytrees, the KV-cache pytree
    ("parallel",),                      # mesh, logical-axis rules, layouts
    ("core",),                          # configs, requests, sampling parameters, the step plan
    ("quant", "speculative", "structured", "text", "default_model"),
    ("kernels_pallas",),
]
RANK = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
MAX_TOP_LEVEL_MODULES = 6
MAX_LINES = 400
LONG_REASON = "over 400 lines"  # a longer module's docstring says why, with these words


@pytest.fixture(scope="module")
def mods() -> dict[str, graph.Module]:
    return graph.load()


def test_every_room_has_a_layer(mods):
    rooms = {graph.package_of(name) for name in mods}
    assert rooms - set(RANK) == set(), "a new room: place it in LAYERS (and docs/ARCHITECTURE.md)"
    assert set(RANK) - rooms == set(), "LAYERS names a room that does not exist"


def test_rooms_import_downward_only(mods):
    upward = {(a, b): found[:3] for (a, b), found in graph.package_edges(mods).items() if RANK[a] >= RANK[b]}
    assert upward == {}


def test_no_import_cycle_between_modules_or_rooms(mods):
    modules = {m.name: {i for i in m.imports if i != "jaxserve"} for m in mods.values()}
    assert graph.cycles(modules) == []
    rooms: dict[str, set[str]] = {}
    for a, b in graph.package_edges(mods):
        rooms.setdefault(a, set()).add(b)
    assert graph.cycles(rooms) == []


def _reached(mods: dict[str, graph.Module], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(mods[name].imports)
    return seen


def test_the_runner_side_imports_nothing_of_the_engine(mods):
    runner = [name for name in mods if graph.package_of(name) == "runner"]
    assert runner
    for name in runner:
        engine = {m for m in _reached(mods, name) if graph.package_of(m) == "engine"}
        assert engine == set(), (name, engine)


@pytest.mark.parametrize("room", ["core", "scheduler"])
def test_core_and_the_scheduler_import_no_jax(mods, room):
    starts = ([name for name in mods if graph.package_of(name) == "core"] if room == "core"
              else ["jaxserve.engine.scheduler"])
    assert starts
    for start in starts:
        with_jax = sorted(m for m in _reached(mods, start) if mods[m].imports_jax)
        assert with_jax == [], (start, with_jax)


def test_few_modules_at_the_top(mods):
    top = [m.name for m in mods.values() if m.path.parent == graph.REPO / "jaxserve" and m.path.name != "__init__.py"]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_no_long_module_without_a_reason(mods):
    long = {m.name: m.lines for m in mods.values() if m.lines > MAX_LINES and graph.package_of(m.name) != "kernels_pallas"
            and LONG_REASON not in " ".join(m.docstring.split())}
    assert long == {}


def test_the_import_graph_sees_function_level_imports_and_skips_type_checking(tmp_path, monkeypatch):
    pkg = tmp_path / "jaxserve"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxserve.core import c\n"
        "def f():\n    from jaxserve.core import b\n    import jax\n")
    (pkg / "core" / "b.py").write_text("from jaxserve.core.a import f\n")
    (pkg / "core" / "c.py").write_text("")
    monkeypatch.setattr(graph, "REPO", tmp_path)
    monkeypatch.setattr(graph, "OURS", ("jaxserve",))
    mods = graph.load()
    assert mods["jaxserve.core.a"].imports == {"jaxserve.core.b"} and mods["jaxserve.core.a"].imports_jax
    assert graph.cycles({m.name: m.imports for m in mods.values()}) == [["jaxserve.core.a", "jaxserve.core.b"]]


def test_the_architecture_map_names_every_room_in_order_and_only_files_that_exist():
    text = (graph.REPO / "docs" / "ARCHITECTURE.md").read_text()
    diagram = text.split("```")[1]
    rows = [line.split()[0] for line in diagram.strip().splitlines()]
    order = [next((i for i, rooms in enumerate(LAYERS) if room in rooms), None) for room in rows]
    assert None not in order and order == sorted(order), rows
    assert {room for rooms in LAYERS[1:] for room in rooms} <= set(diagram.split())
    named = set(re.findall(r"`(jaxserve/[\w/]+\.py)`", text)) | set(re.findall(r"`(jaxserve/[\w/]+/)`", text))
    assert named and [p for p in sorted(named) if not (graph.REPO / p).exists()] == []
