"""The runner's compiled serving programs, held as AOT executables and kept on disk between starts.

JAX's persistent compilation cache keys an executable on its lowered HLO, so a warm restart still
traces and lowers every program before it can look one up: that was ~70 % of a warm start of the
default model (42 programs: 21 forwards, each with the CPU attention's tile loops, 20 samplers, a
page copy; a draft model or EAGLE head adds its own). This table keys a program instead on what
determines it without tracing — the jaxserve/kernels source, the jax and backend versions, the XLA
flags and jax config, the model and engine configs, the mesh, the static arguments and the
shapes/dtypes/shardings of the arguments — and stores the serialized executable with its call
signature (jax.experimental.serialize_executable) under the compilation cache directory. A restart
then deserializes each program and calls it: no trace, no lowering. Sets of programs that no start
has used for two weeks, or beyond the MAX_KEPT_SETS most recently used, are removed (prune).

Steps dispatch through the same table (`Compiled.__call__`, jax's C++ fast path). A call whose
arguments do not match the compiled signature (a sharding the warm-up did not see) falls back to
the jitted function, which compiles as before and is counted as a compilation after warm-up.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import shutil
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Hashable

import jax
from jax.experimental import serialize_executable

logger = logging.getLogger("jaxserve.runner.program_store")

_SOURCE_PACKAGES = ("jaxserve", "kernels_pallas", "checkpoints")
_ENV_FLAGS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "TPU_ACCELERATOR_TYPE")
_SUBDIR = "jaxserve-programs"
# Program sets (one per fingerprint) kept besides the one in use: the most recently used up to this
# many, none idle longer than _MAX_IDLE_S. A jaxserve or jax upgrade, or a config change, makes a
# new set and never reads the old ones again; a set of the default model is ~30 MB, bench-105m's ~45.
MAX_KEPT_SETS = 8
_MAX_IDLE_S = 14 * 24 * 3600

# Every program this process took from or put in the store, by its entry as it is on disk (path,
# size, mtime), kept for the life of the process: XLA:CPU fails at run time ("Function ... not
# found") when the forward programs are deserialized a second time in one process, with or without
# the first copies alive, so each entry is loaded at most once per process and then shared.
_PROCESS_PROGRAMS: dict[tuple[str, int, int], jax.stages.Compiled] = {}
_PROCESS_LOCK = threading.Lock()
_ENTRY_LOCKS: dict[tuple[str, int, int] | None, threading.Lock] = {}


_hits = threading.local()  # this thread's count of jax persistent-cache hits


def _count_hit(event: str, **kwargs: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _hits.count = getattr(_hits, "count", 0) + 1


jax.monitoring.register_event_listener(_count_hit)


def _cache_hits() -> int:
    return getattr(_hits, "count", 0)


def _no_jax_cache_write() -> Any:
    """A context in which jax does not write its own cache entry for what it compiles: the store's
    compiles have module names of their own that no later start asks jax's cache for (the entry
    would double the disk and the serialization time of a cold start)."""
    try:
        from jax._src import config as jax_config  # no public per-thread switch for the cache write
        return jax_config.persistent_cache_min_compile_time_secs(float("inf"))
    except (ImportError, AttributeError, TypeError):
        return contextlib.nullcontext()


def _entry(path: Path) -> tuple[str, int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return str(path), stat.st_size, stat.st_mtime_ns


def _source_digest() -> bytes:
    """sha256 over every source file (.py, and the native kernels' .cc) of the packages that build the
    programs (a code change is a new key)."""
    import importlib.util

    h = hashlib.sha256()
    for name in _SOURCE_PACKAGES:
        found = importlib.util.find_spec(name)
        if found is None or not found.submodule_search_locations:
            continue
        root = Path(next(iter(found.submodule_search_locations)))
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cc")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.digest()


def _config_values() -> str:
    """jax config flags that can change a lowering (plain values; the cache's own settings left out)."""
    items = sorted((k, v) for k, v in jax.config.values.items()
                   if isinstance(v, (str, int, float, bool, type(None))) and "cache" not in k)
    return repr(items)


def fingerprint(*parts: Any) -> str:
    """Everything a program's executable depends on besides its own static arguments and argument
    signature: sources, versions, backend, flags, and `parts` (configs, dtype, mesh, layout rules)."""
    import jaxlib

    devices = jax.devices()
    platform = devices[0].client.platform
    # libtpu's settings matter to TPU programs only (every entry point sets them on other machines)
    env = [k for k in _ENV_FLAGS if platform == "tpu" or not k.startswith(("LIBTPU", "TPU"))]
    h = hashlib.sha256(_source_digest())
    for part in (jax.__version__, jaxlib.__version__, platform,
                 devices[0].client.platform_version, [(d.id, d.device_kind) for d in devices],
                 [os.environ.get(k, "") for k in env], _config_values(), *parts):
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()


def _signature(args: tuple, kwargs: dict) -> str:
    """The dynamic arguments' tree and every leaf's shape, dtype and sharding."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    return repr((str(tree), [(tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves]))


def _stable(value: Any) -> str:
    """A static argument as text that is the same in every process (functions by name, not address)."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}.{value.__qualname__}"
    if hasattr(value, "func"):  # functools.partial
        return f"partial({_stable(value.func)}, {value.args!r}, {sorted(value.keywords.items())!r})"
    return repr(value)


class ProgramTable:
    """Compiled programs by key; on disk under `directory`/jaxserve-programs/`fingerprint` (None: in
    memory only). devices: the ones the programs run on (a loaded executable is placed on them).
    Every entry already stored for this fingerprint starts loading in the background at once (two
    threads: deserializing an XLA:CPU executable links its code, ~0.15 s, outside the GIL), so a
    warm-up mostly finds its programs loaded; preload=False leaves that to `preload()` (a background
    warm-up first reads the few programs it serves with, then the rest)."""

    def __init__(self, directory: str | Path | None, fingerprint: str, devices: list[Any],
                 preload: bool = True) -> None:
        self._dir = Path(directory) / _SUBDIR / fingerprint[:32] if directory else None
        if self._dir is not None:
            prune(self._dir)
        self._devices = devices
        self._name_suffix = fingerprint[:12]
        self._jits: dict[Any, Any] = {}  # function -> its jax.jit under this fingerprint's name
        self._lock = threading.Lock()
        self._compiled: dict[Hashable, jax.stages.Compiled] = {}
        self._pending: dict[str, Future] = {}  # file name -> its load, started by preload()
        self.loaded = 0     # programs from the store (read from disk, or already in this process)
        self.compiled = 0   # programs compiled (XLA's own cache may still have served them)
        if preload:
            self.preload()

    def preload(self) -> None:
        """Starts loading every entry stored for this fingerprint that no call has asked for yet."""
        entries = sorted(self._dir.glob("*.bin")) if self._dir is not None and self._dir.is_dir() else []
        with _PROCESS_LOCK:
            entries = [path for path in entries if _entry(path) not in _PROCESS_PROGRAMS]
        entries = [path for path in entries if path.name not in self._pending]  # loaded ones are in the process
        if entries:
            pool = ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1), thread_name_prefix="jaxserve-load")
            self._pending.update({path.name: pool.submit(self._load, path) for path in entries})
            pool.shutdown(wait=False)

    def clear(self) -> None:
        """Drops this table's programs (those from the store stay in the process: _PROCESS_PROGRAMS)."""
        self._compiled.clear()
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()

    def call(self, key: Hashable, fn: Any, statics: dict[str, Any], donate: tuple[str, ...], *args: Any,
             **kwargs: Any) -> Any:
        """fn(*args, **kwargs, **statics) through the program compiled for `key` (the caller's name
        for the program: same key, same statics and signature). fn: a jax.jit of a function whose
        static arguments are `statics`' names and donated ones `donate`. A key seen for the first
        time is loaded from disk or compiled."""
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self._load_or_compile(fn, statics, donate, args, kwargs)
        try:
            return compiled(*args, **kwargs)
        except (TypeError, ValueError) as e:  # raised before anything runs or is donated
            logger.warning("program %s called with another signature than compiled (%s): jit recompiles", key,
                           str(e).splitlines()[0])
            return fn(*args, **kwargs, **statics)

    def compile_ahead(self, key: Hashable, fn: Any, statics: dict[str, Any], donate: tuple[str, ...], *args: Any,
                      **kwargs: Any) -> None:
        """Loads or compiles the program for `key` without running it, as `call` would on its first
        use: args may be ShapeDtypeStructs (with the shardings the real arguments will have), so a
        background thread can prepare programs while steps run (runner/background_compile.py)."""
        if key not in self._compiled:
            self._compiled[key] = self._load_or_compile(fn, statics, donate, args, kwargs)

    def _own_jit(self, fn: Any, static_argnames: tuple[str, ...], donate_argnames: tuple[str, ...]) -> Any:
        """`fn`'s function jitted again under a name of this fingerprint's (the HLO module's name is
        part of jax's cache key): compiling it is a real compile, never a load from jax's cache."""
        fun = fn.__wrapped__
        with self._lock:  # the serving thread and a background compile may both ask
            jitted = self._jits.get(fun)
            if jitted is None:
                @functools.wraps(fun)
                def program(*args: Any, **kwargs: Any) -> Any:
                    return fun(*args, **kwargs)

                program.__name__ = program.__qualname__ = f"{fun.__name__}_{self._name_suffix}"
                jitted = self._jits[fun] = jax.jit(program, static_argnames=static_argnames,
                                                   donate_argnames=donate_argnames)
        return jitted

    def _path(self, fn: Any, statics: dict[str, Any], args: tuple, kwargs: dict) -> Path | None:
        """The program's entry: its function's name and a hash of its signature and statics (None,
        with a warning, when a static argument's text holds an address: a new key in every process)."""
        text = "\0".join([_signature(args, kwargs)] + [f"{k}={_stable(v)}" for k, v in sorted(statics.items())])
        if " at 0x" in text:
            logger.warning("%s has a static argument without a stable text: not stored (...%s)", fn.__name__,
                           text[text.index(" at 0x") - 60:][:100])
            return None
        return self._dir / f"{fn.__name__}-{hashlib.sha256((fn.__name__ + text).encode()).hexdigest()[:32]}.bin"

    def _load_or_compile(self, fn: Any, statics: dict[str, Any], donate: tuple[str, ...], args: tuple,
                         kwargs: dict) -> jax.stages.Compiled:
        path = self._path(fn, statics, args, kwargs) if self._dir is not None else None
        if path is not None:
            future = self._pending.pop(path.name, None)
            if future is not None and future.cancel():
                future = None  # not started: read it here rather than after the entries queued before it
            if future is not None or path.exists():
                try:
                    compiled = future.result() if future is not None else self._load(path)
                    with self._lock:
                        self.loaded += 1
                    return compiled
                except Exception as e:  # noqa: BLE001 — a bad entry is recompiled and rewritten
                    logger.warning("compiled program %s unreadable (%s: %s): compiling it", path.name,
                                   type(e).__name__, e)
        with self._lock:
            self.compiled += 1
        if path is None:
            return fn.lower(*args, **kwargs, **statics).compile()
        hits = _cache_hits()
        with _no_jax_cache_write():
            compiled = self._own_jit(fn, tuple(statics), donate).lower(*args, **kwargs, **statics).compile()
        if _cache_hits() != hits:
            logger.info("program %s came from jax's compilation cache: not stored (re-serialized, such an "
                        "XLA:CPU executable fails when loaded)", path.name)
        elif self._write(path, compiled):
            with _PROCESS_LOCK:
                _PROCESS_PROGRAMS[_entry(path)] = compiled
        return compiled

    def _load(self, path: Path) -> jax.stages.Compiled:
        """The entry at `path`, deserialized unless this process has it already (any thread)."""
        entry = _entry(path)
        with _PROCESS_LOCK:
            entry_lock = _ENTRY_LOCKS.setdefault(entry, threading.Lock())
        with entry_lock:  # never two copies of one entry, even briefly
            compiled = _PROCESS_PROGRAMS.get(entry)
            if compiled is None:
                payload, in_tree, out_tree = pickle.loads(zlib.decompress(path.read_bytes()))
                compiled = _PROCESS_PROGRAMS[entry] = serialize_executable.deserialize_and_load(
                    payload, in_tree, out_tree, execution_devices=self._devices)
        return compiled

    @staticmethod
    def _write(path: Path, compiled: jax.stages.Compiled) -> bool:
        """Stores `compiled` at `path`; False when it cannot be serialized or written."""
        try:
            data = zlib.compress(pickle.dumps(serialize_executable.serialize(compiled)), 1)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, path)  # atomic: a concurrent start reads a whole entry or none
            return True
        except Exception as e:  # noqa: BLE001 — serving goes on without the entry
            logger.warning("could not store compiled program %s (%s: %s)", path.name, type(e).__name__, e)
            return False


def prune(current: Path) -> None:
    """Marks the program set `current` as used now and removes the other sets of its store that are
    idle longer than _MAX_IDLE_S or older than the MAX_KEPT_SETS most recently used. Only
    directories named like a set (32 hex digits) are touched."""
    now = time.time()
    with contextlib.suppress(OSError):
        if current.is_dir():
            os.utime(current, (now, now))
    try:
        others = sorted(((used, d) for d in current.parent.iterdir()
                         if d != current and (used := _set_used(d)) is not None), reverse=True)
    except OSError:  # no store yet
        return
    for i, (used, d) in enumerate(others):
        if i < MAX_KEPT_SETS and now - used <= _MAX_IDLE_S:
            continue
        size = sum(_size(f) for f in d.glob("*"))
        shutil.rmtree(d, ignore_errors=True)  # a concurrent start may remove it first
        logger.info("removed the unused compiled programs %s (%.1f MB)", d, size / 1e6)


def _size(path: Path) -> int:
    """A file's bytes; 0 when another start removed it first."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _set_used(path: Path) -> float | None:
    """When the program set at `path` was last used (its mtime), or None if it is not a set."""
    name = path.name
    if len(name) != 32 or any(c not in "0123456789abcdef" for c in name) or path.is_symlink():
        return None
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime if path.is_dir() else None


def cache_directory() -> str | None:
    """The persistent compilation cache directory jax uses (engine/loading.enable_compilation_cache), or None
    when it is off or programs span processes (a multi-host executable is not loaded alone)."""
    directory = jax.config.jax_compilation_cache_dir
    return directory if directory and jax.process_count() == 1 else None

