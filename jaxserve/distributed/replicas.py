"""`jaxserve serve --data-parallel-size N` and `--disaggregate P:D`: engine processes on disjoint
device sets of this host, and in front of them on the requested port the router (N replicas) or
the prefill/decode proxy (P `--kv-role prefill` and D `--kv-role decode` instances).

Replica i runs `jaxserve serve` with the same flags on 127.0.0.1:(port + 1 + i) (its own /metrics
there too), seeing only devices [i*d, (i+1)*d) of the host, d = the devices one replica's mesh
uses. Devices are handed out through each platform's own variables, read before JAX starts: CPU
(a process of d host devices), GPU (CUDA_VISIBLE_DEVICES), TPU (TPU_VISIBLE_CHIPS with per-process
bounds, and a port of its own per process). On a CPU the compute is the cores, not the host
devices (which all run on every core): replicas get disjoint sets of the cores this process may
use (every thread of a replica, XLA's included, runs on its share only), so a prefill instance's
long prompt cannot take the cores of a decode instance's step; and, unless a pool size or share is
given, each sizes its KV pool from its share of the RAM (every replica reads the same available
RAM at start-up). The parent never starts a JAX backend: it would claim every device.
SIGTERM/SIGINT stop the front, then every replica (each drains as `serve` does); a
replica also gets SIGTERM if the parent dies any other way (Linux), so none outlives it. A replica
that exits with an error (its port taken, a load or compile error, a crash) stops the launcher too,
which exits 1 naming it: a front that silently serves on fewer replicas than asked hides the
failure from whoever supervises the process.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Any, Callable, Sequence

from jaxserve.core.capacity import DEFAULT_MEMORY_UTILIZATION

logger = logging.getLogger("jaxserve.router")

# chips per replica -> TPU_CHIPS_PER_PROCESS_BOUNDS (a replica's chips as a slab of the host's grid)
_TPU_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1"}


def local_platform(env: dict[str, str] | None = None) -> str:
    """cpu, gpu or tpu: JAX_PLATFORMS if set, else what device files the host has."""
    env = os.environ if env is None else env
    named = env.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if named:
        return {"cuda": "gpu", "rocm": "gpu"}.get(named, named)
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return "tpu"
    if glob.glob("/dev/nvidia[0-9]*"):
        return "gpu"
    return "cpu"


def replica_env(platform: str, index: int, devices: int, env: dict[str, str]) -> dict[str, str]:
    """The environment of replica `index` that sees `devices` devices of its own."""
    env = dict(env)
    ids = ",".join(str(i) for i in range(index * devices, (index + 1) * devices))
    if platform == "cpu":
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
        env["JAX_PLATFORMS"] = "cpu"
    elif platform == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = ids
    elif platform == "tpu":
        if devices not in _TPU_BOUNDS:
            raise ValueError(f"--data-parallel-size on TPU: a replica of {devices} chips is not supported (1, 2 or 4)")
        env.update(TPU_VISIBLE_CHIPS=ids, TPU_CHIPS_PER_PROCESS_BOUNDS=_TPU_BOUNDS[devices],
                   TPU_PROCESS_BOUNDS="1,1,1", TPU_PROCESS_PORT=str(8476 + index))
    else:
        raise ValueError(f"--data-parallel-size: unknown platform {platform!r}")
    return env


def split_cores(cores: Sequence[int], replicas: int) -> list[list[int]] | None:
    """Disjoint, contiguous, near-equal shares of `cores` for `replicas` CPU replicas (the first
    ones get one more where it does not divide); None when there are fewer cores than replicas."""
    cores = sorted(cores)
    if len(cores) < replicas:
        return None
    share, extra = divmod(len(cores), replicas)
    out, start = [], 0
    for i in range(replicas):
        end = start + share + (i < extra)
        out.append(cores[start:end])
        start = end
    return out


_POOL_FLAGS = ("--memory-utilization", "--kv-cache-memory", "--num-kv-pages")


def cpu_pool_share(argv: Sequence[str], replicas: int) -> list[str]:
    """The flags that size each CPU replica's KV pool from its share of the RAM the CPU default
    would take, unless `argv` sizes the pool itself."""
    if any(a.split("=", 1)[0] in _POOL_FLAGS for a in argv):
        return []
    return ["--memory-utilization", f"{DEFAULT_MEMORY_UTILIZATION['cpu'] / replicas:.4g}"]


def replica_argv(argv: Sequence[str], port: int) -> list[str]:
    """`serve` flags for one replica: the user's, without the replica layout, host and port."""
    drop = {"--data-parallel-size", "--disaggregate", "--kv-role", "--host", "--port"}
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in drop:
            skip = "=" not in a
            continue
        out.append(a)
    return [*out, "--host", "127.0.0.1", "--port", str(port)]


def _replica_setup(cores: Sequence[int] | None) -> Callable[[], None]:
    """Popen preexec_fn: SIGTERM to the replica when its parent dies, however it dies (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing); on `cores` only when given."""
    def setup() -> None:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
        if cores is not None:
            os.sched_setaffinity(0, cores)
    return setup


def watch_replicas(procs: Sequence[subprocess.Popen], stopping: threading.Event, failed: list[str],
                   stop: Callable[[], None] = lambda: os.kill(os.getpid(), signal.SIGTERM)) -> None:
    """Until `stopping`: the first replica to exit with an error is recorded in `failed` and the
    launcher is stopped (`stop`: SIGTERM to itself; uvicorn's own handler then stops the front; the replicas are stopped
    after it). A replica that drained on a signal (exit 0, or killed by SIGINT/SIGTERM) is not a
    failure: Ctrl-C reaches the replicas too, before the launcher sets `stopping`."""
    stopped = (None, 0, -signal.SIGINT, -signal.SIGTERM)
    while not stopping.wait(0.5):
        for i, p in enumerate(procs):
            if p.poll() not in stopped:
                failed.append(f"replica {i} (pid {p.pid}) exited with {p.returncode}")
                logger.error("%s on its own: stopping the other replicas and the front", failed[0])
                stop()
                return


def serve_replicas(argv: Sequence[str], roles: Sequence[Sequence[str]], devices_per_replica: int, host: str,
                   port: int, front: Callable[[list[str]], Any], log_level: str = "info") -> int:
    """Starts one `serve` process per entry of `roles` (the flags that entry adds) and serves
    `front(their URLs)` until a signal (0) or until a replica exits with an error (1)."""
    import uvicorn

    platform = local_platform()
    pinnable = platform == "cpu" and hasattr(os, "sched_setaffinity")  # Linux
    shares = split_cores(os.sched_getaffinity(0), len(roles)) if pinnable else None
    if pinnable and shares is None:
        logger.warning("%d CPU replicas on %d cores: they share every core", len(roles), len(os.sched_getaffinity(0)))
    serve_at = argv.index("serve")
    pool = cpu_pool_share(argv[serve_at + 1:], len(roles)) if platform == "cpu" else []
    procs = []
    urls = []
    for i, role in enumerate(roles):
        rport = port + 1 + i
        cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli", *argv[:serve_at + 1], *replica_argv(argv[serve_at + 1:], rport),
               *pool, *role]
        cores = shares[i] if shares else None
        procs.append(subprocess.Popen(cmd, env=replica_env(platform, i, devices_per_replica, dict(os.environ)),
                                      preexec_fn=_replica_setup(cores)))
        urls.append(f"http://127.0.0.1:{rport}")
        logger.info("replica %d%s: pid %d on %s (devices %d..%d of this %s host%s)", i, "".join(f" {a}" for a in role),
                    procs[-1].pid, urls[-1], i * devices_per_replica, (i + 1) * devices_per_replica - 1, platform,
                    f"; cores {','.join(map(str, cores))}" if cores else "")
    # uvicorn re-raises the SIGTERM it handled once it has stopped; with the default disposition that
    # would end this process before the replicas below are stopped and waited for.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    stopping, failed = threading.Event(), []
    try:  # the watcher's SIGTERM may come at once: its SystemExit must land in this try
        threading.Thread(target=watch_replicas, args=(procs, stopping, failed), daemon=True).start()
        logger.info("serving http://%s:%d over %d replicas", host, port, len(roles))
        uvicorn.run(front(urls), host=host, port=port, log_level=log_level, access_log=False,
                    log_config=None)  # the root handler's format, as the replicas' (launch.py)
    except SystemExit:
        if not failed:
            raise
    finally:
        stopping.set()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for i, p in enumerate(procs):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            logger.info("replica %d exited with %d", i, p.returncode)
    if failed:
        logger.error("stopped: %s", failed[0])
        return 1
    return 0


def serve_data_parallel(argv: Sequence[str], replicas: int, devices_per_replica: int, host: str, port: int,
                        log_level: str = "info") -> int:
    """`serve --data-parallel-size`: the replicas behind the router."""
    from jaxserve.distributed.router import build_router

    return serve_replicas(argv, [()] * replicas, devices_per_replica, host, port, build_router, log_level)
