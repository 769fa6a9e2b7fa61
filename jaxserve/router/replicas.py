"""`jaxserve serve --data-parallel-size N`: N engine processes on disjoint device sets of this
host, and the router in front of them on the requested port.

Replica i runs `jaxserve serve` with the same flags on 127.0.0.1:(port + 1 + i) (its own /metrics
there too), seeing only devices [i*d, (i+1)*d) of the host, d = the devices one replica's mesh
uses. Devices are handed out through each platform's own variables, read before JAX starts: CPU
(a process of d host devices), GPU (CUDA_VISIBLE_DEVICES), TPU (TPU_VISIBLE_CHIPS with per-process
bounds, and a port of its own per process). The parent never starts a JAX backend: it would claim
every device. SIGTERM/SIGINT stop the router, then every replica (each drains as `serve` does).
"""

from __future__ import annotations

import glob
import logging
import os
import signal
import subprocess
import sys
from typing import Sequence

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


def replica_argv(argv: Sequence[str], port: int) -> list[str]:
    """`serve` flags for one replica: the user's, without the data-parallel size, host and port."""
    drop = {"--data-parallel-size", "--host", "--port"}
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


def serve_data_parallel(argv: Sequence[str], replicas: int, devices_per_replica: int, host: str, port: int,
                        log_level: str = "info") -> int:
    """Starts the replicas and serves the router until a signal; returns the exit code."""
    import uvicorn

    from jaxserve.router.app import build_router

    platform = local_platform()
    serve_at = argv.index("serve")
    procs = []
    urls = []
    for i in range(replicas):
        rport = port + 1 + i
        cmd = [sys.executable, "-m", "jaxserve.cli", *argv[:serve_at + 1], *replica_argv(argv[serve_at + 1:], rport)]
        procs.append(subprocess.Popen(cmd, env=replica_env(platform, i, devices_per_replica, dict(os.environ))))
        urls.append(f"http://127.0.0.1:{rport}")
        logger.info("replica %d: pid %d on %s (devices %d..%d of this %s host)", i, procs[-1].pid, urls[-1],
                    i * devices_per_replica, (i + 1) * devices_per_replica - 1, platform)
    try:
        logger.info("router on http://%s:%d over %d replicas", host, port, replicas)
        uvicorn.run(build_router(urls), host=host, port=port, log_level=log_level, access_log=False)
    finally:
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
    return 0
