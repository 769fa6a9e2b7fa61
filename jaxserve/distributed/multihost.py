"""Multi-host (multi-controller) serving: one program over the devices of several processes.

Every process runs JAX's distributed runtime (`jax.distributed.initialize`) and builds the same
engine over the global mesh; rank 0 (the leader) alone runs HTTP, tokenization and the scheduler.
Each device call the leader's model runner makes (a step's forward, its sampler) is first sent to
every follower over a step channel, so all processes dispatch the same jitted programs, in the
same order, each feeding its own shards; sampled ids stay on the leader.

The step channel is one `multiprocessing.connection` per follower (length-prefixed pickles,
HMAC-authenticated with JAXSERVE_MULTIHOST_KEY; run it on the cluster's private network only):
  leader -> follower: ("config", EngineConfig)   the leader's resolved sizes, checked against the
                                                 follower's own before warm-up
                      ("forward", StepInputs), ("sample", bitmask or None), ("stop",), ("beat",)
  follower -> leader: ("hello", rank), then ("beat",) every HEARTBEAT_SECONDS
A process that hears nothing from a peer for `stall_timeout` seconds, or loses its connection,
logs the rank and leaves with exit code 1 at once (os._exit): a collective whose peer is gone
would otherwise block forever.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

logger = logging.getLogger("jaxserve.distributed.multihost")

HEARTBEAT_SECONDS = 1.0
DEFAULT_STALL_TIMEOUT = 10.0
CONNECT_TIMEOUT = 300.0  # followers may start minutes apart on a cluster


@dataclasses.dataclass(frozen=True)
class MultiHost:
    """`jaxserve serve --num-hosts N --host-rank R --coordinator HOST:PORT`. rank/coordinator None:
    JAX's auto-detection (Cloud TPU VMs, SLURM, ...). The step channel listens on the leader at the
    coordinator's host, port + 1 unless `step_port` is given."""

    num_hosts: int
    rank: int | None = None
    coordinator: str | None = None
    step_port: int | None = None
    stall_timeout: float = DEFAULT_STALL_TIMEOUT

    def __post_init__(self) -> None:
        if self.num_hosts < 2:
            raise ValueError(f"--num-hosts must be >= 2 for multi-host serving, got {self.num_hosts}")
        if self.rank is not None and not 0 <= self.rank < self.num_hosts:
            raise ValueError(f"--host-rank must be in [0, {self.num_hosts}), got {self.rank}")
        if self.coordinator is not None and not _split_address(self.coordinator)[1]:
            raise ValueError(f"--coordinator must be HOST:PORT, got {self.coordinator!r}")
        if self.stall_timeout <= HEARTBEAT_SECONDS:
            raise ValueError(f"the stall timeout must exceed the {HEARTBEAT_SECONDS}s heartbeat")

    def step_address(self) -> tuple[str, int]:
        coordinator = self.coordinator
        if coordinator is None:  # auto-detected: JAX knows the coordinator it connected to
            from jax._src import distributed
            coordinator = distributed.global_state.coordinator_address
        host, port = _split_address(coordinator)
        return host, self.step_port or port + 1


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port) if port.isdigit() else 0


def _authkey() -> bytes:
    return os.environ.get("JAXSERVE_MULTIHOST_KEY", "jaxserve-multihost").encode()


def initialize(mh: MultiHost) -> int:
    """Joins the distributed runtime (before anything touches a JAX backend); returns this rank.
    CPU processes reach each other's devices through gloo collectives."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU client reads it
    jax.distributed.initialize(coordinator_address=mh.coordinator, num_processes=mh.num_hosts,
                               process_id=mh.rank)
    rank = jax.process_index()
    logger.info("multi-host: rank %d of %d, %d local of %d devices", rank, jax.process_count(),
                jax.local_device_count(), jax.device_count())
    return rank


def _die(message: str) -> None:
    logger.critical("%s: exiting", message)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(1)


def _watch(conn: Connection, peer: str, stall_timeout: float, on_message: Callable[[Any], None],
           closing: threading.Event) -> None:
    """Reads `conn` until told to stop; a silent or closed peer ends the process (unless this
    process is `closing` the channel itself)."""
    while True:
        try:
            if not conn.poll(stall_timeout):
                if closing.is_set():
                    return
                _die(f"{peer} sent nothing (not even a heartbeat) for {stall_timeout:.0f}s")
            message = conn.recv()
        except (EOFError, OSError) as e:
            if closing.is_set():
                return
            _die(f"{peer} closed its connection ({type(e).__name__}: the process died or was stopped)")
        if message[0] == "stop":
            on_message(message)
            return
        if message[0] != "beat":
            on_message(message)


def _heartbeat(send: Callable[[tuple], None], stopped: threading.Event) -> None:
    while not stopped.wait(HEARTBEAT_SECONDS):
        try:
            send(("beat",))
        except OSError:
            return  # the watcher on this connection reports it


def _accept(address: tuple[str, int], count: int) -> dict[int, Connection]:
    """rank -> connection of `count` followers, each introduced by ("hello", rank); RuntimeError
    naming the missing ranks after CONNECT_TIMEOUT."""
    arrived: queue.Queue[tuple[int, Connection]] = queue.Queue()
    listener = Listener(address, authkey=_authkey())

    def accept() -> None:  # a thread: Listener.accept has no timeout
        while True:
            try:
                conn = listener.accept()
                kind, rank = conn.recv()
            except (OSError, EOFError):
                return  # the listener closed
            if kind == "hello":
                arrived.put((rank, conn))

    threading.Thread(target=accept, name="jaxserve-accept", daemon=True).start()
    logger.info("multi-host: waiting for %d follower(s) on port %d", count, address[1])
    conns: dict[int, Connection] = {}
    deadline = time.monotonic() + CONNECT_TIMEOUT
    try:
        while len(conns) < count:
            try:
                rank, conn = arrived.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(1, count + 1)) - set(conns))
                raise RuntimeError(f"multi-host: rank(s) {missing} did not connect within "
                                   f"{CONNECT_TIMEOUT:.0f}s") from None
            conns[rank] = conn
    finally:
        listener.close()
    return conns


class Followers:
    """The leader's end: a connection per follower, a heartbeat to each, a watcher on each."""

    def __init__(self, mh: MultiHost) -> None:
        host, port = mh.step_address()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.conns = _accept(("0.0.0.0" if host not in ("127.0.0.1", "localhost") else host, port),
                             mh.num_hosts - 1)
        for rank, conn in self.conns.items():
            threading.Thread(target=_watch, args=(conn, f"rank {rank}", mh.stall_timeout, self._unexpected,
                                                  self._stopped),
                             name=f"jaxserve-watch-rank{rank}", daemon=True).start()
        threading.Thread(target=_heartbeat, args=(self.send, self._stopped), name="jaxserve-heartbeat",
                         daemon=True).start()
        logger.info("multi-host: %d follower(s) connected", len(self.conns))

    @staticmethod
    def _unexpected(message: Any) -> None:
        if message[0] == "stop":
            _die("a follower stopped on its own")

    def send(self, message: tuple) -> None:
        """One pickle for every follower, made before taking the lock (the heartbeat shares it):
        what Connection.send would do per follower, once."""
        payload = ForkingPickler.dumps(message)
        with self._lock:
            for conn in self.conns.values():
                conn.send_bytes(payload)

    def close(self) -> None:
        """Tells the followers to exit (0) and stops the heartbeat."""
        self._stopped.set()
        try:
            self.send(("stop",))
        except OSError:
            pass


def connect(mh: MultiHost, rank: int) -> tuple[Connection, "queue.Queue[Any]"]:
    """A follower's end: connects to the leader (retrying while it starts), then a heartbeat to it
    and a watcher that queues the leader's messages. Returns (connection, message queue)."""
    address = mh.step_address()
    deadline = time.monotonic() + CONNECT_TIMEOUT
    while True:
        try:
            conn = Client(address, authkey=_authkey())
            break
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"multi-host: the leader's step channel {address[0]}:{address[1]} did not "
                                   f"answer within {CONNECT_TIMEOUT:.0f}s") from None
            time.sleep(0.2)
    conn.send(("hello", rank))
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            conn.send(message)

    messages: queue.Queue[Any] = queue.Queue()
    threading.Thread(target=_watch, args=(conn, "rank 0 (the leader)", mh.stall_timeout, messages.put,
                                          threading.Event()),
                     name="jaxserve-watch-leader", daemon=True).start()
    threading.Thread(target=_heartbeat, args=(send, threading.Event()), name="jaxserve-heartbeat",
                     daemon=True).start()
    return conn, messages


def follow(runner: Any, messages: "queue.Queue[Any]") -> int:
    """Runs the leader's device calls on this process's shards until it says stop; returns 0."""
    inputs = logits = None
    steps = 0
    while True:
        message = messages.get()
        op = message[0]
        if op == "forward":
            inputs = message[1]
            logits = runner.forward(inputs)
        elif op == "move":
            runner.move_pages(message[1], message[2])
        elif op == "sample":
            runner.sample(logits, inputs, message[1])
            steps += 1
        elif op == "stop":
            logger.info("multi-host: the leader stopped after %d steps here", steps)
            return 0
        else:
            raise RuntimeError(f"multi-host: unknown step-channel message {op!r}")


def check_supported(engine_cfg: Any) -> None:
    """What multi-host serving does not mirror yet, refused by name."""
    spec = engine_cfg.speculative_config
    if spec is not None and spec.method != "ngram":
        raise ValueError(f"multi-host serving: speculative method {spec.method!r} is not supported yet "
                         "(its proposals run on the device; ngram is)")
    if engine_cfg.enable_lora:
        raise ValueError("multi-host serving: --enable-lora is not supported yet")
    if engine_cfg.kv_role is not None:  # the export/import/pull programs are not mirrored to followers
        raise ValueError(f"--kv-role {engine_cfg.kv_role} (PD disaggregation) with --num-hosts > 1 is not "
                         "supported yet: the KV export, import and pull steps run on the leader only")


def run_follower(model: str | None, engine_cfg: Any, mh: MultiHost) -> int:
    """A follower process: connects, builds the engine alongside the leader (the same programs in
    the same order; machine.py gives every process rank 0's memory figures, so the pools agree),
    checks its sizes against the leader's, warms up, then follows its steps. Returns the exit code."""
    import jax

    from jaxserve.engine.loading import load_engine_core

    rank = jax.process_index()
    _, messages = connect(mh, rank)
    core, _, _ = load_engine_core(model, engine_cfg, warmup=False)
    op, leaders = messages.get()
    if op != "config":
        raise RuntimeError(f"multi-host: expected the leader's engine config first, got {op!r}")
    if core.engine_cfg != leaders:
        diff = {f.name: (getattr(leaders, f.name), getattr(core.engine_cfg, f.name))
                for f in dataclasses.fields(leaders) if getattr(leaders, f.name) != getattr(core.engine_cfg, f.name)}
        raise ValueError(f"multi-host: rank {rank} resolved a different engine than rank 0 (rank 0's, this "
                         f"rank's): {diff}; start every rank with the same flags")
    core.runner.warmup()
    logger.info("multi-host: rank %d ready, following the leader's steps", rank)
    return follow(core.runner, messages)
