"""Serving before every program is compiled: the forward buckets left out of a background warm-up
compile on a thread of their own while steps run on the buckets already compiled.

A bucket (T, S) is ready when its forward programs (every logits width L of it) and the samplers of
those widths (every history width H) are compiled. Steps only ever take a ready bucket: the engine
limits the scheduler to the largest ready bucket (`limit`), so a step that would have wanted a
larger one is split into more steps, and nothing compiles on the request path. The order follows
traffic: when the scheduler reports that the limit held it back (in tokens or in sequences), the
next bucket compiled is the cheapest one that grows that dimension; otherwise the cheapest one.

Host-side bookkeeping only; `compile_one` (the model runner's) does the compiling.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Callable, Iterable

from jaxserve.core.buckets import Program

logger = logging.getLogger("jaxserve.runner.background_compile")

Bucket = tuple[int, int]


def largest(buckets: Iterable[Bucket]) -> Bucket:
    """The bucket a step may fill: the most tokens x sequences, then the most sequences."""
    return max(buckets, key=lambda b: (b[0] * b[1], b[1]))


def bucket_programs(programs: Iterable[Program]) -> dict[Bucket, list[Program]]:
    """(T, S) -> the programs that make it ready: its forwards, then the samplers of their logits
    widths (a sampler serves every bucket of its width, so it appears under each)."""
    programs = list(programs)
    samplers: dict[int, list[Program]] = {}
    for p in programs:
        if p.kind == "sample":
            samplers.setdefault(p.rows, []).append(p)
    out: dict[Bucket, list[Program]] = {}
    for p in programs:
        if p.kind == "forward":
            out.setdefault((p.tokens, p.rows), []).append(p)
    for bucket, forwards in out.items():
        widths = sorted({p.logits for p in forwards})
        out[bucket] = forwards + [s for w in widths for s in samplers.get(w, [])]
    return out


def first_programs(programs: list[Program]) -> list[Program]:
    """What a background warm-up compiles before serving: the smallest bucket's programs and the
    page copy, in `programs`' order."""
    by_bucket = bucket_programs(programs)
    keep = set(by_bucket[min(by_bucket)]) | {p for p in programs if p.kind == "copy"}
    return [p for p in programs if p in keep]


class BucketCompiler:
    """Compiles the programs of `programs` not in `compiled` on a daemon thread, bucket by bucket.

    compile_one(program) compiles one program (from shapes: nothing runs); on_ready(buckets) is
    called on that thread with the ready buckets, smallest first, each time a bucket becomes ready."""

    def __init__(self, programs: list[Program], compiled: Iterable[Program],
                 compile_one: Callable[[Program], None], on_ready: Callable[[list[Bucket]], None]) -> None:
        self._by_bucket = bucket_programs(programs)
        self._compiled = set(compiled)
        self._compile_one = compile_one
        self._on_ready = on_ready
        self.declared = len(programs)
        self.failed: str | None = None
        self.pressure: str | None = None  # "tokens" | "seqs": what the limit held back lately
        self._ready = sorted(b for b, ps in self._by_bucket.items() if self._compiled.issuperset(ps))
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxserve-compile", daemon=True)
        self.started = time.perf_counter()
        self.seconds: float | None = None  # until every program was compiled

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    @property
    def ready(self) -> list[Bucket]:
        return self._ready

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def limit(self) -> Bucket:
        """The ready bucket a step may fill."""
        return largest(self._ready)

    def start(self) -> "BucketCompiler":
        self._on_ready(list(self._ready))
        self._thread.start()
        atexit.register(self.stop, wait=True)  # an interpreter must not finalize under a running compile
        return self

    def stop(self, wait: bool = False) -> None:
        """No further program starts compiling; wait: until the one compiling now is done."""
        self._stop.set()
        if wait and self._thread.is_alive():
            self._thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until every program is compiled (or compiling failed); False on timeout."""
        return self._done.wait(timeout)

    def _next(self) -> Bucket | None:
        waiting = [b for b in self._by_bucket if b not in self._ready]
        if not waiting:
            return None
        t, s = self.limit()
        grows = {"tokens": lambda b: b[0] > t, "seqs": lambda b: b[1] > s}.get(self.pressure, lambda b: True)
        return min(waiting, key=lambda b: (not grows(b), b[0] * b[1], b))

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                bucket = self._next()
                if bucket is None:
                    break
                for program in self._by_bucket[bucket]:
                    if self._stop.is_set():
                        return
                    if program not in self._compiled:
                        start = time.perf_counter()
                        self._compile_one(program)
                        self._compiled.add(program)
                        logger.debug("compiled %s in the background in %.2fs", program.name,
                                     time.perf_counter() - start)
                self._ready = sorted(self._ready + [bucket])
                self._on_ready(list(self._ready))
            self.seconds = time.perf_counter() - self.started
            if not self._stop.is_set():
                logger.info("background compilation done: %d programs in %.1fs; every bucket serves", self.declared,
                            self.seconds)
        except Exception as e:  # noqa: BLE001 — serving goes on with the buckets that are ready
            self.failed = f"{type(e).__name__}: {e}"
            if self._stop.is_set():  # the process is stopping: what a compile met then is not a fault
                logger.debug("background compilation stopped while shutting down (%s)", self.failed)
                return
            logger.error("background compilation stopped (%s); serving goes on with the %d ready buckets",
                         self.failed, len(self._ready))
        finally:
            self._done.set()
            atexit.unregister(self.stop)  # nothing left to wait for (and nothing kept alive by it)
