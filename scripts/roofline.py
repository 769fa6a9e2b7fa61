"""Roofline for a decoder-only model on this machine: measured copy bandwidth and matmul rate against
the bytes and FLOPs a decode / prefill step must move and compute.

    python scripts/roofline.py --config MODEL_DIR/config.json --context-len 512

Counting rules (kept simple and stated, so the test can check them by hand):
- params: per layer q/k/v/o projections (+ their biases when `attention_bias`), gate/up/down MLP,
  two RMSNorm weights (+ q_norm/k_norm of head_dim for Qwen3); a final norm; the embedding
  (V x H); a separate lm_head (V x H) only when embeddings are not tied.
- decode bytes per step = every layer weight + final norm + the full lm_head matrix (the tied
  embedding when tied) + for untied models the `batch` embedding rows gathered
  + KV read (batch x context_len positions, K and V, every layer) + KV write (one position per row).
  `context_len` = tokens each sequence attends to in the step (its cache length after the write).
- FLOPs: 2 x (projection + MLP weights) per token, attention 4 x q_heads x head_dim per attended
  position (QK^T and PV), lm_head 2 x V x H only for rows that need logits (decode: every row;
  prefill: the last token of each sequence). Norms, rotary, softmax are not counted.
- bound = max(bytes / bandwidth, flops / flop_rate).
- a serving workload (workload_flops): a request of P prompt tokens and O output tokens runs
  P + O - 1 tokens through the layers (the last output token is never fed back); the token at
  0-based position i attends to i + 1 positions; lm_head runs once per sampled token, i.e. O times
  (the last prompt token's logits give output token 1, each fed-back output token's give the next).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1, "int8": 1}


def _load_config(config_path: str | Path) -> dict[str, Any]:
    path = Path(config_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"config not found: {path}")
    cfg = json.loads(path.read_text())
    cfg = cfg.get("text_config", cfg)  # multimodal wrappers keep the LM config inside
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in cfg:
            raise ValueError(f"{path}: missing {key!r}; roofline needs a dense decoder-only config")
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        raise ValueError(f"{path}: mixture-of-experts configs are not supported by this roofline")
    return cfg


def model_shape(cfg: dict[str, Any]) -> dict[str, int]:
    """Parameter counts (elements) of the parts the roofline distinguishes."""
    h = int(cfg["hidden_size"])
    n_layers = int(cfg["num_hidden_layers"])
    nq = int(cfg["num_attention_heads"])
    nkv = int(cfg.get("num_key_value_heads") or nq)
    d = int(cfg.get("head_dim") or h // nq)
    inter = int(cfg["intermediate_size"])
    vocab = int(cfg["vocab_size"])
    tied = bool(cfg.get("tie_word_embeddings", False))
    proj = h * nq * d + 2 * h * nkv * d + nq * d * h    # q, k, v, o
    mlp = 3 * h * inter                                 # gate, up, down
    bias = (nq * d + 2 * nkv * d) if (cfg.get("attention_bias") or cfg.get("model_type") == "qwen2") else 0
    norms = 2 * h + (2 * d if cfg.get("model_type", "").startswith("qwen3") else 0)
    return {
        "hidden": h, "layers": n_layers, "q_heads": nq, "kv_heads": nkv, "head_dim": d, "vocab": vocab,
        "tied": int(tied),
        "matmul_params_per_layer": proj + mlp,
        "other_params_per_layer": bias + norms,
        "embed_params": vocab * h,
        "lm_head_params": vocab * h,
        "final_norm_params": h,
        "total_params": n_layers * (proj + mlp + bias + norms) + h + vocab * h * (1 if tied else 2),
    }


def forward_flops(shape: dict[str, int], tokens: int, attended_positions: int, logit_rows: int) -> dict[str, int]:
    """FLOPs of running `tokens` tokens through every layer, attending `attended_positions` (query,
    key) pairs in total per layer, and `logit_rows` rows through lm_head (counting rules above)."""
    layers = shape["layers"]
    matmul = 2 * layers * shape["matmul_params_per_layer"] * tokens
    attention = 4 * shape["q_heads"] * shape["head_dim"] * layers * attended_positions
    lm_head = 2 * shape["lm_head_params"] * logit_rows
    return {"matmul": matmul, "attention": attention, "lm_head": lm_head, "total": matmul + attention + lm_head}


def workload_flops(cfg: dict[str, Any], prompt_lens: Sequence[int], output_lens: Sequence[int]) -> dict[str, int]:
    """FLOPs a whole serving workload must compute (prefill + decode), however it is batched.

    `cfg` is a config dict (config.json contents); request k has prompt_lens[k] prompt tokens and
    output_lens[k] >= 1 output tokens. Returns prefill / decode / total FLOPs and the parts.
    Prefill = the prompt tokens with causal attention + one lm_head row; decode = the O - 1 fed-back
    output tokens, each attending to its whole context, + one lm_head row each.
    """
    if len(prompt_lens) != len(output_lens):
        raise ValueError(f"{len(prompt_lens)} prompt lengths but {len(output_lens)} output lengths")
    s = model_shape(cfg)
    prefill = dict.fromkeys(("matmul", "attention", "lm_head", "total"), 0)
    decode = dict(prefill)
    for p, o in zip(prompt_lens, output_lens):
        p, o = int(p), int(o)
        if p < 1 or o < 1:
            raise ValueError(f"every request needs >= 1 prompt and >= 1 output token, got {p}, {o}")
        fed = o - 1
        # positions 0..p-1 attend to 1..p keys; fed-back token j (1..fed) sits at p + j - 1, attends p + j.
        pre = forward_flops(s, p, p * (p + 1) // 2, 1)
        dec = forward_flops(s, fed, fed * p + fed * (fed + 1) // 2, fed)
        for k in prefill:
            prefill[k] += pre[k]
            decode[k] += dec[k]
    return {"prefill": prefill["total"], "decode": decode["total"], "total": prefill["total"] + decode["total"],
            "matmul": prefill["matmul"] + decode["matmul"], "attention": prefill["attention"] + decode["attention"],
            "lm_head": prefill["lm_head"] + decode["lm_head"],
            "requests": len(prompt_lens), "prompt_tokens": int(sum(prompt_lens)),
            "output_tokens": int(sum(output_lens))}


def roofline(config_path: str | Path, batch: int, context_len: int, bw: float, flops_rate: float,
             weight_bytes_per_param: int | None = None, kv_bytes_per_elem: int | None = None) -> dict[str, float]:
    """Bytes, FLOPs and time bounds of one decode step (batch rows, each attending to context_len
    positions) and of prefilling batch sequences of context_len tokens. bw in bytes/s, flops_rate in FLOP/s.
    """
    if batch < 1 or context_len < 1:
        raise ValueError(f"batch and context_len must be >= 1, got {batch}, {context_len}")
    if bw <= 0 or flops_rate <= 0:
        raise ValueError(f"bw and flops_rate must be > 0, got {bw}, {flops_rate}")
    cfg = _load_config(config_path)
    s = model_shape(cfg)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    if weight_bytes_per_param is None:
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r} in config; pass weight_bytes_per_param")
        weight_bytes_per_param = _DTYPE_BYTES[dtype]
    wb = weight_bytes_per_param
    kvb = kv_bytes_per_elem if kv_bytes_per_elem is not None else wb
    layers = s["layers"]
    layer_params = layers * (s["matmul_params_per_layer"] + s["other_params_per_layer"])

    # Decode: one new token per row.
    gathered_rows = 0 if s["tied"] else batch * s["hidden"]  # tied: the full table is read as lm_head
    weight_bytes = (layer_params + s["final_norm_params"] + s["lm_head_params"] + gathered_rows) * wb
    kv_per_pos = 2 * layers * s["kv_heads"] * s["head_dim"]  # K and V elements per position, all layers
    kv_read = batch * context_len * kv_per_pos * kvb
    kv_write = batch * kv_per_pos * kvb
    decode_bytes = weight_bytes + kv_read + kv_write
    decode_flops = forward_flops(s, batch, batch * context_len, batch)["total"]

    # Prefill: batch sequences of context_len tokens, causal, logits for the last token only.
    tokens = batch * context_len
    prefill_flops = forward_flops(s, tokens, batch * context_len * (context_len + 1) // 2, batch)["total"]
    prefill_bytes = (weight_bytes - gathered_rows * wb + (0 if s["tied"] else tokens * s["hidden"] * wb)
                     + tokens * kv_per_pos * kvb)

    t_mem, t_cmp = decode_bytes / bw, decode_flops / flops_rate
    p_mem, p_cmp = prefill_bytes / bw, prefill_flops / flops_rate
    step = max(t_mem, t_cmp)
    prefill_t = max(p_mem, p_cmp)
    return {
        "batch": batch, "context_len": context_len, "total_params": s["total_params"],
        "weight_bytes": weight_bytes, "kv_read_bytes": kv_read, "kv_write_bytes": kv_write,
        "decode_bytes": decode_bytes, "decode_flops": decode_flops,
        "decode_time_memory_s": t_mem, "decode_time_compute_s": t_cmp, "decode_step_s": step,
        "decode_bound": "memory" if t_mem >= t_cmp else "compute",
        "decode_tokens_per_s": batch / step,
        "prefill_bytes": prefill_bytes, "prefill_flops": prefill_flops, "prefill_s": prefill_t,
        "prefill_bound": "memory" if p_mem >= p_cmp else "compute",
        "prefill_tokens_per_s": tokens / prefill_t,
    }


def median_time(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls of fn (which must wait for its own result)."""
    fn()  # warm-up: page faults, compilation
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def measure_copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5, backend: str = "numpy") -> float:
    """Bytes/s of a large array copy, counting the read and the write (2 x nbytes per copy)."""
    n = nbytes // 4
    if backend == "numpy":
        src = np.ones(n, dtype=np.float32)
        dst = np.empty_like(src)
        t = median_time(lambda: np.copyto(dst, src), repeats)
    elif backend == "jax":
        import jax
        import jax.numpy as jnp

        x = jnp.ones(n, dtype=jnp.float32)
        copy = jax.jit(lambda a: a + 1.0)  # a fresh output buffer: one read + one write (x + 0 may be elided)
        t = median_time(lambda: copy(x).block_until_ready(), repeats)
    else:
        raise ValueError(f"backend must be 'numpy' or 'jax', got {backend!r}")
    return 2 * n * 4 / t


def measure_read_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s of XLA streaming through a large float32 array (a jitted sum: reads only). A decode
    step mostly reads (weights, KV), so this is the bandwidth it can hope for; the copy bandwidth
    above is the roofline's stated denominator."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones(nbytes // 4, dtype=jnp.float32)
    total = jax.jit(jnp.sum)
    return nbytes / median_time(lambda: total(x).block_until_ready(), repeats)


def measure_matmul_rate(sizes: tuple[int, ...] = (512, 1024, 2048), repeats: int = 3) -> tuple[float, int]:
    """Best-over-sizes median FLOP/s of a float32 jnp.dot [n, n] @ [n, n] (2 n^3 FLOPs); returns (rate, n)."""
    import jax
    import jax.numpy as jnp

    best, best_n = 0.0, sizes[0]
    dot = jax.jit(jnp.dot)
    for n in sizes:
        a = jnp.ones((n, n), jnp.float32)
        b = jnp.ones((n, n), jnp.float32)
        rate = 2 * n**3 / median_time(lambda: dot(a, b).block_until_ready(), repeats)
        if rate > best:
            best, best_n = rate, n
    return best, best_n


def format_rows(rows: list[dict[str, float]]) -> str:
    head = (f"{'batch':>6}{'ctx':>7}{'dec MB/step':>13}{'dec GFLOP':>11}{'step ms':>10}{'bound':>9}"
            f"{'dec tok/s':>11}{'prefill ms':>12}{'pf bound':>10}{'pf tok/s':>11}")
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['batch']:>6}{r['context_len']:>7}{r['decode_bytes'] / 1e6:>13.1f}{r['decode_flops'] / 1e9:>11.3f}"
            f"{r['decode_step_s'] * 1e3:>10.2f}{r['decode_bound']:>9}{r['decode_tokens_per_s']:>11.1f}"
            f"{r['prefill_s'] * 1e3:>12.1f}{r['prefill_bound']:>10}{r['prefill_tokens_per_s']:>11.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Roofline bounds for a model config on this machine.")
    p.add_argument("--config", required=True, help="config.json or a model dir")
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--bw-gbs", type=float, help="skip the measurement: copy bandwidth in GB/s")
    p.add_argument("--gflops", type=float, help="skip the measurement: matmul rate in GFLOP/s")
    p.add_argument("--copy-mib", type=int, default=256)
    p.add_argument("--kv-bytes", type=int, help="bytes per KV element (default: the weights' dtype)")
    a = p.parse_args(argv)
    if a.bw_gbs:
        bw = a.bw_gbs * 1e9
    else:
        bw_np = measure_copy_bandwidth(a.copy_mib << 20, backend="numpy")
        bw_jax = measure_copy_bandwidth(a.copy_mib << 20, backend="jax")
        print(f"copy bandwidth: numpy {bw_np / 1e9:.2f} GB/s, jax {bw_jax / 1e9:.2f} GB/s (read + write)")
        bw = max(bw_np, bw_jax)
    if a.gflops:
        rate = a.gflops * 1e9
    else:
        rate, n = measure_matmul_rate()
        print(f"matmul rate: {rate / 1e9:.1f} GFLOP/s (float32 jnp.dot, n={n})")
    batches = [int(x) for x in a.batches.split(",")]
    rows = [roofline(a.config, b, a.context_len, bw, rate, kv_bytes_per_elem=a.kv_bytes) for b in batches]
    print(f"model: {a.config}  params: {rows[0]['total_params'] / 1e6:.2f} M  "
          f"bw {bw / 1e9:.2f} GB/s  rate {rate / 1e9:.1f} GFLOP/s")
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
