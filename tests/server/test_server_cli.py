"""`jaxserve` argument wiring: flags -> EngineConfig / ServerConfig, and `jaxserve bench` as the
README runs it, against a real server."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
from server_utils import MODEL, start_server

from jaxserve.entrypoints import cli, engine_args


def engine_config(*flags: str):
    args = cli.build_parser().parse_args(["serve", *flags])
    return engine_args.engine_config(args, "m")


def test_engine_flags_reach_the_engine_config():
    cfg = engine_config("--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
                        "--page-size", "32", "--num-kv-pages", "99", "--kv-cache-memory", "2GiB",
                        "--no-enable-prefix-caching", "--mesh", "2x4", "--dtype", "bfloat16",
                        "--scheduling-policy", "priority", "--token-buckets", "32,1024",
                        "--compilation-cache-dir", "/tmp/x", "--max-waiting-requests", "7",
                        "--no-async-scheduling", "--memory-utilization", "0.7", "--seq-buckets", "2,4")
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.page_size) == (512, 8, 128, 32)
    assert cfg.num_kv_pages == 99 and cfg.kv_cache_memory == 2 * 2**30 and not cfg.enable_prefix_caching
    assert cfg.mesh_shape == (2, 4) and cfg.dtype == "bfloat16" and cfg.scheduling_policy == "priority"
    # buckets above the step budget are dropped; the budget itself is always a bucket
    assert cfg.resolved_token_buckets() == (32, 128) and cfg.resolved_seq_buckets() == (2, 4, 8)
    assert cfg.compilation_cache_dir == "/tmp/x" and cfg.max_waiting_requests == 7
    assert not cfg.async_scheduling and cfg.memory_utilization == 0.7
    assert engine_config("--token-buckets", "auto", "--max-num-batched-tokens", "256").resolved_token_buckets() \
        == (16, 64, 128, 256)
    assert engine_config("--tensor-parallel-size", "4").mesh_shape == (1, 4)


def test_no_sizing_flags_leave_every_size_to_the_machine():
    cfg = engine_config()
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.num_kv_pages,
            cfg.kv_cache_memory, cfg.memory_utilization, cfg.token_buckets, cfg.seq_buckets,
            cfg.compilation_cache_dir) == (None,) * 9
    assert cfg.enable_prefix_caching and cfg.mesh_shape == (1, 1) and cfg.dtype is None
    assert cfg.async_scheduling


def test_contradicting_mesh_flags_are_an_error():
    with pytest.raises(ValueError, match="contradicts"):
        engine_config("--mesh", "1x2", "--tensor-parallel-size", "4")


@pytest.mark.parametrize("flags", [["--mesh", "4"], ["--mesh", "0x2"], ["--kv-cache-memory", "lots"],
                                   ["--token-buckets", "8,x"], ["--request-timeout", "0"],
                                   ["--memory-utilization", "1.5"],
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
    out = capsys.readouterr().out
    assert out.startswith("usage: jaxserve bench ") and "--base-url" in out


def test_bench_as_the_readme_runs_it_against_a_real_server(loaded_model):
    """`jaxserve bench --base-url URL --model jaxserve-tiny ...`: no --tokenizer (the embedded
    model's is the default), the real script, a real server; two tiny requests."""
    live = start_server(loaded_model)
    out = io.StringIO()
    try:  # not capsys: with a live uvicorn server in the test, capsys's teardown fails (closed file)
        with contextlib.redirect_stdout(out):
            code = cli.main(["bench", "--base-url", live.url, "--model", MODEL, "--num-requests", "2",
                             "--prompt-len-min", "4", "--prompt-len-max", "8", "--output-len-min", "2",
                             "--output-len-max", "3"])
    finally:
        live.stop()
    assert code == 0, out.getvalue()
    assert re.search(r"requests completed / failed\s+2 / 0", out.getvalue()), out.getvalue()


CHAT_TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}ASSISTANT:"


def test_chat_template_flag_renders_chats_with_it_and_leaves_the_shared_tokenizer_alone(loaded_model, tmp_path):
    from server_utils import client_for

    from jaxserve.text.tokenizer import read_chat_template

    path = tmp_path / "template.jinja"
    path.write_text(CHAT_TEMPLATE)
    tokenizer = loaded_model[1]
    messages = [{"role": "user", "content": "Hi there"}]
    ours = tokenizer.encode("<<user>> Hi there\nASSISTANT:", add_special_tokens=False)
    own = tokenizer.apply_chat_template(messages)
    assert ours != own
    live = start_server(loaded_model, chat_template=read_chat_template(str(path)))
    try:
        reply = client_for(live).chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    finally:
        live.stop()
    assert reply.usage.prompt_tokens == len(ours)
    assert tokenizer.apply_chat_template(messages) == own  # the session's tokenizer keeps the model's template


def test_chat_template_flag_takes_a_file_or_the_template_and_refuses_what_does_not_compile(tmp_path, capsys):
    from jaxserve.text.tokenizer import read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text(CHAT_TEMPLATE)
    assert read_chat_template(str(path)) == read_chat_template(CHAT_TEMPLATE) == CHAT_TEMPLATE
    with pytest.raises(ValueError, match="no such file, and not a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        read_chat_template("{% for m in messages %}{{ m }}")
    assert cli.main(["serve", "--chat-template", "{{ unclosed"]) == 2  # refused before any model loads
    assert "--chat-template: the template does not compile" in capsys.readouterr().err
