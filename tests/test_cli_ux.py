"""What a user of the `jaxserve` command sees: --help with every default, usage errors that name
the subcommand and the bad flag, `jaxserve bench` without a --tokenizer, and the engine config
`jaxserve generate` derives for its one request (its run is tested in tests/test_llm.py, beside the
LLM it must agree with)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from jaxserve.entrypoints import cli, engine_args
from jaxserve.server import commands

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_serving  # noqa: E402


def help_entries(argv: list[str], capsys: pytest.CaptureFixture) -> dict[str, str]:
    """`jaxserve ARGV --help` -> {first option string: its help text on one line}."""
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--help"])
    assert exc.value.code == 0
    entries: dict[str, str] = {}
    flag = None
    for line in capsys.readouterr().out.splitlines():
        m = re.match(r"^  (-[-\w]+)", line)
        if m:
            flag = m.group(1)
            entries[flag] = line
        elif flag and line.startswith("    "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return entries


@pytest.mark.parametrize("command", ["serve", "generate", "convert", "bench"])
def test_every_flag_of_every_subcommand_shows_its_default(command, capsys):
    entries = help_entries([command], capsys)
    required = {"--prompt", "--base-url", "--model"} - ({"--model"} if command != "bench" else set())
    missing = [f for f, text in entries.items() if f not in required | {"-h"} and "(default" not in text]
    assert entries and not missing, f"`jaxserve {command} --help` shows no default for {missing}"


def test_help_shows_the_parsers_actual_default_values(capsys):
    defaults = cli.build_parser().parse_args(["serve"])
    entries = help_entries(["serve"], capsys)
    assert f"(default: {defaults.page_size})" in entries["--page-size"]
    assert f"(default: {defaults.port})" in entries["--port"]
    assert "(default: True)" in entries["--enable-prefix-caching"]


def test_defaults_read_as_the_flag_would_be_written():
    parser = argparse.ArgumentParser(prog="p", formatter_class=cli.HelpFormatter)
    parser.add_argument("--buckets", default=(16, 64), help="sizes")
    parser.add_argument("--stop", action="append", default=[], help="stops")
    parser.add_argument("--limit", default=None, help="bound")
    parser.add_argument("--model", default=None, help="a directory (default: the embedded model)")
    parser.add_argument("--share", default=0.5, help="100%% = all")
    text = " ".join(parser.format_help().split())
    assert "sizes (default: 16,64)" in text and "stops (default: none)" in text and "bound (default: none)" in text
    assert "(default: the embedded model)" in text and "(default: None)" not in text
    assert "100% = all (default: 0.5)" in text


def test_help_does_not_print_an_api_key_taken_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("JAXSERVE_API_KEY", "sk-secret-value")
    entries = help_entries(["serve"], capsys)
    assert "sk-secret-value" not in entries["--api-key"] and "$JAXSERVE_API_KEY" in entries["--api-key"]


@pytest.mark.parametrize("argv", [["serve", "--bogus-flag"], ["generate", "--prompt", "x", "--bogus-flag"],
                                  ["convert", "a", "b", "--bogus-flag"]])
def test_an_unknown_flag_prints_the_subcommands_usage_and_names_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: jaxserve {argv[0]} "), err[:200]
    assert f"jaxserve {argv[0]}: error: unrecognized arguments: --bogus-flag" in err


def test_bench_help_usage_names_the_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: jaxserve bench "), out[:200]
    assert "(default: 64)" in out  # bench's flags show their defaults too


# ----------------------------------------------------------------------------- bench's tokenizer

def test_bench_tokenizer_defaults_to_the_models_directory(tmp_path):
    from jaxserve.default_model import MODEL_NAME, ensure_default_model

    assert bench_serving.default_tokenizer(MODEL_NAME) == str(ensure_default_model())
    assert bench_serving.default_tokenizer(str(tmp_path)) == str(tmp_path)


def test_bench_without_a_tokenizer_for_an_unknown_model_names_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--base-url", "http://127.0.0.1:9", "--model", "no-such-model"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: jaxserve bench" in err and "--tokenizer" in err and "no-such-model" in err


def test_bench_plot_without_matplotlib_fails_before_the_run(monkeypatch, capsys, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    with pytest.raises(SystemExit) as exc:
        bench_serving.main(["--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", str(tmp_path),
                            "--plot", str(tmp_path / "plots")], prog="jaxserve bench")
    assert exc.value.code == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


# ----------------------------------------------------------------------------- generate

def cli_config(command: str, *flags: str):
    argv = [command, *flags] + (["--prompt", "unused"] if command == "generate" else [])
    return engine_args.engine_config(cli.build_parser().parse_args(argv), "jaxserve-tiny")


def test_generate_runs_serves_engine_and_refuses_a_request_beyond_the_context_before_loading():
    assert cli_config("generate").program_fields() == cli_config("serve").program_fields()
    assert cli_config("generate").warmup == cli_config("serve").warmup == "background"
    assert cli_config("serve", "--warmup", "full").warmup == "full"
    commands.check_request_fits(cli_config("generate"), 1000, 100, model_max_len=1100)
    with pytest.raises(ValueError, match="exceeds the context limit 1000"):
        commands.check_request_fits(cli_config("generate", "--max-model-len", "1000"), 990, 11, 4096)
    with pytest.raises(ValueError, match="exceeds the context limit 1100"):
        commands.check_request_fits(cli_config("generate"), 1000, 101, model_max_len=1100)


def test_kv_cache_dtype_flag_reaches_the_engine_config_and_rejects_unknown_names(capsys):
    assert cli_config("serve").kv_cache_dtype == "auto"
    assert cli_config("serve", "--kv-cache-dtype", "fp8").kv_cache_dtype == "fp8"
    assert cli_config("generate", "--kv-cache-dtype", "int8").kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_speculative_config_flag_reaches_the_engine_config_and_bad_json_is_named(capsys):
    assert cli_config("serve").speculative_config is None
    spec = cli_config("serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}')
    assert spec.speculative_config.method == "ngram" and spec.speculative_config.num_speculative_tokens == 4
    for bad, words in (('{"method": "ngram"', "not JSON"), ('{"method": "medusa", "num_speculative_tokens": 2}',
                                                            "'medusa' is not one of"),
                       ('{"method": "eagle3", "model": "/d", "num_speculative_tokens": 2}',
                        "EAGLE-3 head directory '/d' does not exist")):
        assert cli.main(["generate", "--prompt", "x", "--speculative-config", bad]) != 0
        assert words in capsys.readouterr().err


def test_attention_backend_choices_are_the_kernels_backends():
    """The CLI lists the backend names itself (it must not import jax for --help); every name
    kernels_pallas serves is accepted and nothing else is."""
    from kernels_pallas import BACKENDS

    parser = cli.build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    flag = next(a for a in serve._actions if a.dest == "attention_backend")
    assert set(flag.choices) == set(BACKENDS)
    for name in BACKENDS:
        assert parser.parse_args(["serve", "--attention-backend", name]).attention_backend == name


# ----------------------------------------------------------------------------- vLLM's flags

def test_version_prints_the_installed_version(capsys):
    import importlib.metadata
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"jaxserve {importlib.metadata.version('jaxserve')}"


def test_vllm_spellings_set_the_same_engine_fields():
    vllm = cli_config("serve", "--gpu-memory-utilization", "0.7", "--block-size", "32", "--swap-space", "4")
    ours = cli_config("serve", "--memory-utilization", "0.7", "--page-size", "32", "--kv-offload-gib", "4")
    assert (vllm.memory_utilization, vllm.page_size, vllm.kv_offload_gib) == (0.7, 32, 4.0)
    assert vllm == ours
    parsed = cli.build_parser().parse_args(["serve", "/models/qwen", "--uvicorn-log-level", "warning"])
    assert (parsed.model_tag, parsed.uvicorn_log_level) == ("/models/qwen", "warning")


def test_a_positional_model_is_the_model_and_two_different_models_are_refused(capsys):
    args = cli.build_parser().parse_args(["serve", "Qwen/Qwen3-0.6B"])
    with pytest.raises(ValueError, match="two models named"):
        cli._dispatch(cli.build_parser().parse_args(["serve", "a/b", "--model", "c/d"]), [])
    assert args.model is None and args.model_tag == "Qwen/Qwen3-0.6B"
    assert cli.main(["serve", "a/b", "--model", "c/d"]) == 2
    assert "two models named: a/b (positional) and --model c/d" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--enable-chunked-prefill", "--enforce-eager", "--disable-log-requests"])
def test_a_vllm_flag_for_what_jaxserve_always_does_is_accepted_and_says_so(flag, caplog):
    import logging

    from jaxserve.entrypoints import vllm_flags
    args = cli.build_parser().parse_args(["serve", flag])
    assert cli_config("serve", flag) == cli_config("serve")  # changes nothing in the engine
    with caplog.at_level(logging.INFO, logger="jaxserve.entrypoints.vllm_flags"):
        vllm_flags.log_notes(args)
    assert caplog.messages == [f"{flag}: {vllm_flags.NOTED[flag]}"]


def test_trust_remote_code_is_refused_with_the_reason(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--trust-remote-code"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--trust-remote-code is not supported: jaxserve runs no code from a checkpoint" in err


@pytest.mark.parametrize("flag,words", [("--pipeline-parallel-size=2", "--tensor-parallel-size N or --mesh"),
                                        ("--num-gpu-blocks-override", "use --num-kv-pages"),
                                        ("--disable-uvicorn-access-log", "use --no-access-log")])
def test_an_unknown_vllm_flag_gets_a_hint_naming_jaxserves_equivalent(flag, words, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", flag, *(["7"] if "=" not in flag and "override" in flag else [])])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {flag}" in err
    assert f"{flag.split('=')[0]} is vLLM's: " in err and words in err


def test_generate_help_lists_only_what_one_request_uses(capsys):
    generate = set(help_entries(["generate"], capsys))
    serve = set(help_entries(["serve"], capsys))
    server_only = {"--kv-role", "--kv-offload-gib", "--scheduling-policy", "--max-waiting-requests", "--enable-lora",
                   "--max-loras", "--max-lora-rank", "--lora-modules", "--max-cpu-loras"}
    assert server_only <= serve and not server_only & generate
    assert {"--model", "--max-model-len", "--speculative-config", "--prompt", "--max-tokens"} <= generate
    # what generate leaves out still configures its engine as serve's defaults do (one program store)
    assert cli_config("generate") == dataclasses.replace(cli_config("serve"))
