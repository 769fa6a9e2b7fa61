"""`jaxserve` argument wiring: flags -> EngineConfig / ServerConfig (no model is loaded here)."""

from __future__ import annotations

import pytest

from jaxserve import cli


def engine_config(*flags: str):
    args = cli.build_parser().parse_args(["serve", *flags])
    return cli._engine_config(args, "m")


def test_serve_defaults_are_cpu_friendly():
    cfg = engine_config()
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens) == (2048, 16, 256)
    assert cfg.resolved_token_buckets() == (16, 64, 256) and cfg.resolved_seq_buckets() == (16,)
    assert cfg.enable_prefix_caching and cfg.mesh_shape == (1, 1) and cfg.dtype is None
    assert cfg.async_scheduling


def test_engine_flags_reach_the_engine_config():
    cfg = engine_config("--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
                        "--page-size", "32", "--num-kv-pages", "99", "--kv-cache-memory", "2GiB",
                        "--no-enable-prefix-caching", "--mesh", "2x4", "--dtype", "bfloat16",
                        "--scheduling-policy", "priority", "--token-buckets", "32,1024",
                        "--compilation-cache-dir", "/tmp/x", "--max-waiting-requests", "7",
                        "--no-async-scheduling")
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.page_size) == (512, 8, 128, 32)
    assert cfg.num_kv_pages == 99 and cfg.kv_cache_memory == 2 * 2**30 and not cfg.enable_prefix_caching
    assert cfg.mesh_shape == (2, 4) and cfg.dtype == "bfloat16" and cfg.scheduling_policy == "priority"
    # buckets above the step budget are dropped; the budget itself is always a bucket
    assert cfg.token_buckets == (32, 128) and cfg.seq_buckets == (8,)
    assert cfg.compilation_cache_dir == "/tmp/x" and cfg.max_waiting_requests == 7
    assert not cfg.async_scheduling
    assert engine_config("--token-buckets", "auto").resolved_token_buckets() == (16, 32, 64, 128, 256)
    assert engine_config("--tensor-parallel-size", "4").mesh_shape == (1, 4)


def test_contradicting_mesh_flags_are_an_error():
    with pytest.raises(ValueError, match="contradicts"):
        engine_config("--mesh", "1x2", "--tensor-parallel-size", "4")


@pytest.mark.parametrize("flags", [["--mesh", "4"], ["--mesh", "0x2"], ["--kv-cache-memory", "lots"],
                                   ["--token-buckets", "8,x"], ["--request-timeout", "0"],
                                   ["--scheduling-policy", "random"]])
def test_invalid_flags_exit_with_usage_error(flags, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["serve", *flags])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_bench_passes_every_argument_to_the_bench_script(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    assert exc.value.code == 0
    assert "--base-url" in capsys.readouterr().out
